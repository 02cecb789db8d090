/* The int4 unpack of mlaquant's fast CPU decode path (mlaquant/attention/native.py builds this file with the system
 * C compiler and calls it through ctypes; mlaquant/attention/cpu_decode.py has the torch version it replaces).
 *
 * unpack_int4: n rows of packed int4 codes, `stride` bytes apart, `width` bytes each (channel 2j in the low
 * nibble of byte j, channel 2j + 1 in the high one) -> out, n rows of 2 * width bytes, dense:
 * [low nibbles (width) | high nibbles (width)] per row. Unsigned (0..15) or, with `sign`, less 8 (-8..7,
 * two's complement int8: symmetric codes are stored q + 8). One pass over the rows, 8 bytes per step;
 * rows split across `threads` OpenMP threads (the runtime torch's own operators use, where torch links
 * libgomp: a second one would spin beside it). */
#include <stdint.h>
#include <string.h>

#define LOW 0x0F0F0F0F0F0F0F0FULL
#define TOP 0x8080808080808080ULL
#define EIGHT 0x0808080808080808ULL

/* x - 8 in every byte of x (bytes 0..15): setting bit 7 first keeps a byte's borrow inside it. */
static inline uint64_t less_eight(uint64_t x) { return ((x | TOP) - EIGHT) ^ TOP; }

static void unpack_row(const uint8_t *src, int64_t width, uint8_t *lo, uint8_t *hi, int sign) {
    int64_t k = 0;
    for (; k + 8 <= width; k += 8) {
        uint64_t w, a, b;
        memcpy(&w, src + k, 8);
        a = w & LOW;
        b = (w >> 4) & LOW;
        if (sign) {
            a = less_eight(a);
            b = less_eight(b);
        }
        memcpy(lo + k, &a, 8);
        memcpy(hi + k, &b, 8);
    }
    for (; k < width; k++) {
        lo[k] = (uint8_t)((src[k] & 15) - (sign ? 8 : 0));
        hi[k] = (uint8_t)((src[k] >> 4) - (sign ? 8 : 0));
    }
}

void unpack_int4(const uint8_t *rows, int64_t n, int64_t stride, int64_t width, uint8_t *out, int sign,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint8_t *lo = out + i * 2 * width;
        unpack_row(rows + i * stride, width, lo, lo + width, sign);
    }
}
