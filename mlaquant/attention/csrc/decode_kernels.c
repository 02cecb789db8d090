/* Integer kernels of mlaquant's fast CPU decode path and W8A8 projections, on the stored codes.
 * mlaquant/attention/native.py builds this one file once per ISA variant (-DMLAQ_ISA=0 scalar, 1 avx2, 2 avx512vnni,
 * 3 avxvnni; always with -ffp-contract=off) and calls it through ctypes; mlaquant/attention/cpu_decode.py states the
 * formulas and their error bound.
 *
 * Codes as they enter a dot (c'): int8 sym q (stored int8), int8 asym q - 128 (stored uint8), int4 sym nibble - 8,
 * int4 asym nibble (channel 2j in the low nibble of byte j), int3 / int2 sym u - 4 / u - 2 (the bands of a band
 * codec: a little-endian bit stream, channel c at bits 3c.. / 2c..). A part's bytes: codes, then one FP16 scale per
 * group at scale_off, then (asym) one FP16 zero point per group at zero_off. A band c_kv part enters as one part per
 * stored band (row-wise: one group), its scale_off reaching the band's scale after the codes of every band. Rows: row t of a block is at
 * base + (pages ? pages[t / page_rows] * page_rows + t % page_rows : t) * stride (a paged pool read in place).
 *
 *   mlaq_dots    c[b][m][n] = sum_k a[b][m][k] * c'(row n of batch b, k): exact INT32 (wrapping arithmetic, so any
 *                result that fits in int32 is exact whatever the order)
 *   mlaq_scores  out[h][t] (+)= sum over 1-8 parts, sum_g (qs[h][g] * s[t][g]) * dot_g + (asym) (sum_g q8 *
 *                qs[h][g]) * zp[t][g], parts and groups in order; zp = lo + 128 s (int8 asym) or lo (int4 asym)
 *   mlaq_pv      acc[h][c] (* alpha) += (float)(M_g / 32767 * S[h][c]) + z[h][g], S = sum_t P_g[h][t] * c' exact
 *                (INT32 per <= 256-token chunk, |P| <= 32767, |c'| <= 128; chunks summed in FP64, exact below 2^53),
 *                P_g[h][t] = rint(p[h][t] * (s[t][g] * (32767 / M_g))), M_g = max_t |s[t][g]|, z = sum_t p * zp in a
 *                fixed 8-lane order; or from a block's scores with the online-softmax step inside: m = max(m_run,
 *                block max from mlaq_scores), p = exp2(x - m) (`exp2_scalar`: same FP32 ops in every variant),
 *                acc and l_run rescaled by exp2(m_run - m), l_run += sum_t p (8-lane order)
 *   mlaq_decode  per sequence and block: mlaq_scores, then that softmax step once and the P.V of each c_kv part (a
 *                band c_kv: each band into its channels; channels of 0-bit bands stay 0)
 *
 * Every variant performs the same FP32 / FP64 operations in the same order (lane-wise, vectors over tokens or
 * channels, never across a reduction), so all of them give the same bits; the integer sums are exact in all.
 * Vector forms: avx2 sign-extends int8 codes to int16 for _mm256_madd_epi16 (maddubs would saturate on u8 x s8
 * pairs of offset codes, and the sign trick breaks on code -128) and runs int4 codes through _mm256_maddubs_epi16 as
 * unsigned nibbles (at most 2 * 15 * 128 per pair, no saturation); the VNNI forms run vpdpbusd on u8 codes (int8:
 * the byte XOR 0x80, then -128 * sum a) and vpdpwssd for P.V (avx512vnni: zmm, P as an embedded broadcast, 16 heads
 * per B load; its VNNI instructions as inline asm, which keeps accumulators in registers where GCC 12 copies them
 * around the builtins). Scores of short parts (bands, k_pe, small groups; on VNNI sub-byte ones only) run token-lane:
 * the rows packed with the tokens across a vector's lanes, so no horizontal reduction (the comment above
 * `token_lanes`). Hot loops are small
 * non-inlined functions specialized by code kind and tile shape.
 * Threads: OpenMP, `threads` of them (the runtime torch uses). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MLAQ_SCALAR 0
#define MLAQ_AVX2 1
#define MLAQ_AVX512VNNI 2
#define MLAQ_AVXVNNI 3
#ifndef MLAQ_ISA
#define MLAQ_ISA MLAQ_SCALAR
#endif
#define VECTOR (MLAQ_ISA != MLAQ_SCALAR)
#define VNNI (MLAQ_ISA == MLAQ_AVX512VNNI || MLAQ_ISA == MLAQ_AVXVNNI)
#define LANES VECTOR /* token-lane scores (`token_lanes`) in every vector variant */

#if VECTOR
#include <immintrin.h>
#endif
#if MLAQ_ISA == MLAQ_AVX2
/* acc + x, written into acc's register (GCC 12 adds into x's register and copies it back: a move per accumulator
 * and step, which the hot loops cannot spare at 6 instructions a cycle) */
static inline __attribute__((always_inline)) __m256i add32_into(__m256i acc, __m256i x) {
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(x));
    return acc;
}
static inline __attribute__((always_inline)) __m256i add16_into(__m256i acc, __m256i x) {
    __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(x));
    return acc;
}
#define ADD32(acc, x) add32_into(acc, x)
#else
#define ADD32(acc, x) _mm256_add_epi32(acc, x)
#endif
#if MLAQ_ISA == MLAQ_AVX512VNNI
static inline __attribute__((always_inline)) __m256i dpbusd_y(__m256i acc, __m256i u, __m256i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
static inline __attribute__((always_inline)) __m256i dpwssd_y(__m256i acc, __m256i a, __m256i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
/* acc += b . (the int32 at p in every lane), the broadcast folded into the instruction */
static inline __attribute__((always_inline)) __m512i dpwssd_z_bcast(__m512i acc, __m512i b, const int32_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*p));
    return acc;
}
#endif
#if MLAQ_ISA == MLAQ_AVX512VNNI
/* inline asm: the accumulator stays in its register (GCC copies it around the VNNI builtins in every iteration) */
#define DPBUSD(acc, u, s) dpbusd_y(acc, u, s)
#define DPWSSD(acc, a, b) dpwssd_y(acc, a, b)
#ifndef DOT_NT
#define DOT_NT 4 /* rows per dot tile: 16 accumulators of the 32 ymm registers */
#endif
#ifndef PV_MT
#define PV_MT 16 /* heads per P.V tile (zmm) */
#endif
#elif MLAQ_ISA == MLAQ_AVXVNNI
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#endif
#ifndef DOT_NT
#define DOT_NT 2
#endif
#ifndef PV_MT
#define PV_MT 4
#endif
#define DOT_MT 4     /* a rows (heads) per dot tile */
#define CH 32        /* channels per dot chunk (a chunk never crosses a group; the last one of a group may be short) */
#define TT 64        /* tokens per scores tile */
#define SLAB 16      /* channels per P.V slab */
#ifndef PV_CHUNK
#define PV_CHUNK 256 /* tokens per INT32 P.V sum: 256 * 32767 * 128 < 2^31 */
#endif
#define TB 16      /* rows per token-lane scores block: two vectors of 8 */
#define QCHUNK 128 /* tokens per probability-quantization chunk (even): its [pair][head] block stays in L1 */
#define INLINE static inline __attribute__((always_inline))

enum { I8_SYM = 0, I8_ASYM = 1, I4_SYM = 2, I4_ASYM = 3, I3_SYM = 4, I2_SYM = 5, U8_CODES = 6 };
/* U8_CODES: internal, bit-stream codes already unpacked to one unsigned byte each (`rows_dots`) */
#define IS_INT4(kind) ((kind) == I4_SYM || (kind) == I4_ASYM)
#define SUB_BYTE(kind) ((kind) >= I4_SYM) /* unsigned codes of < 8 bits: maddubs / vpdpbusd take them as they are */
#define BITS(kind) ((kind) <= I8_ASYM || (kind) == U8_CODES ? 8 : (kind) <= I4_ASYM ? 4 : (kind) == I3_SYM ? 3 : 2)
#define BIAS(kind) ((kind) == I4_SYM ? 8 : (kind) == I3_SYM ? 4 : (kind) == I2_SYM ? 2 : 0) /* stored = c' + bias */
#define IS_ASYM(kind) ((kind) == I8_ASYM || (kind) == I4_ASYM)

int mlaq_isa(void) { return MLAQ_ISA; }

/* Bit i set where the CPU (and OS) supports feature i: 0 avx2, 1 fma, 2 f16c, 3 avx512f, 4 avx512bw, 5 avx512vl,
 * 6 avx512vnni, 7 avxvnni. Built into every variant; native.py asks the scalar one. */
unsigned mlaq_cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f |= (unsigned)(__builtin_cpu_supports("avx2") != 0) << 0;
    f |= (unsigned)(__builtin_cpu_supports("fma") != 0) << 1;
    f |= (unsigned)(__builtin_cpu_supports("f16c") != 0) << 2;
    f |= (unsigned)(__builtin_cpu_supports("avx512f") != 0) << 3;
    f |= (unsigned)(__builtin_cpu_supports("avx512bw") != 0) << 4;
    f |= (unsigned)(__builtin_cpu_supports("avx512vl") != 0) << 5;
    f |= (unsigned)(__builtin_cpu_supports("avx512vnni") != 0) << 6;
    f |= (unsigned)(__builtin_cpu_supports("avxvnni") != 0) << 7;
#endif
    return f;
}

typedef struct {
    int kind;
    int64_t width, gs, groups, nch; /* channels, group size, groups, CH-channel chunks per group */
    int64_t scale_off, zero_off;    /* bytes from the row's start */
} part_t;

static part_t make_part(int kind, int64_t width, int64_t gs, int64_t scale_off, int64_t zero_off) {
    part_t p = {kind, width, gs, width / gs, (gs + CH - 1) / CH, scale_off, zero_off};
    return p;
}

/* rows[i] = row t0 + i for i < n: one division, then page by page. */
static void rows_from(const uint8_t *base, const int64_t *pages, int64_t page_rows, int64_t stride, int64_t t0,
                      int64_t n, const uint8_t **rows) {
    if (!pages) {
        for (int64_t i = 0; i < n; i++) rows[i] = base + (t0 + i) * stride;
        return;
    }
    int64_t page = t0 / page_rows, slot = t0 % page_rows;
    const uint8_t *at = base + (pages[page] * page_rows + slot) * stride;
    for (int64_t i = 0; i < n; i++) {
        rows[i] = at;
        at += stride;
        if (++slot == page_rows && i + 1 < n) {
            slot = 0;
            at = base + pages[++page] * page_rows * stride;
        }
    }
}

static void *alloc(size_t bytes) { /* 64-byte aligned, at least 64 bytes */
    return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
}

/* This thread's buffer `slot` of at least `bytes` (64-byte aligned, contents undefined), kept for the next call: the
 * decode's large per-block buffers, which fresh from malloc (mmap above its threshold) would take their page faults
 * on every block. Valid until the same thread asks for the same slot again. */
enum { SC_SCORES, SC_PROBS, SC_ROWS, SC_S, SC_ZP, SC_P, SC_S64, SC_SLAB, SC_TILE, SC_W8_CODES, SC_W8_ABS, SC_W8_SCALE,
       SC_SLOTS };
static __thread struct {
    void *ptr;
    size_t bytes;
} scratch_slots[SC_SLOTS];
static void *scratch(int slot, size_t bytes) {
    if (scratch_slots[slot].bytes < bytes) {
        free(scratch_slots[slot].ptr);
        scratch_slots[slot].ptr = alloc(bytes);
        scratch_slots[slot].bytes = bytes;
    }
    return scratch_slots[slot].ptr;
}

static inline int32_t code_at(const uint8_t *codes, int kind, int64_t c) {
    switch (kind) {
    case I8_SYM: return (int8_t)codes[c];
    case I8_ASYM: return (int32_t)codes[c] - 128;
    case I4_SYM: return (int32_t)((codes[c >> 1] >> ((c & 1) * 4)) & 15) - 8;
    case I4_ASYM: return (codes[c >> 1] >> ((c & 1) * 4)) & 15;
    case I3_SYM: { /* a little-endian bit stream: channel c at bits 3c..3c+2 */
        int64_t bit = 3 * c, at = bit >> 3, sh = bit & 7;
        uint32_t v = codes[at] | (sh > 5 ? (uint32_t)codes[at + 1] << 8 : 0u);
        return (int32_t)((v >> sh) & 7) - 4;
    }
    default: return (int32_t)((codes[c >> 2] >> ((c & 3) * 2)) & 3) - 2;
    }
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if VECTOR
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u, bits;
    if (e == 0 && m == 0) {
        bits = sign;
    } else if (e == 0) { /* subnormal: m * 2^-24 */
        uint32_t shift = 0;
        while (!(m & 1024u)) {
            m <<= 1;
            shift++;
        }
        bits = sign | ((113u - shift) << 23) | ((m & 1023u) << 13);
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* s[g * ld], z[g * ld] (asym: lo + 128 s for int8, lo for int4) of one row. */
static inline void load_params(const part_t *p, const uint8_t *row, float *s, float *z, int64_t ld) {
    for (int64_t g = 0; g < p->groups; g++) {
        float sv = half_to_float(row + p->scale_off + 2 * g);
        s[g * ld] = sv;
        if (IS_ASYM(p->kind)) {
            float lo = half_to_float(row + p->zero_off + 2 * g);
            z[g * ld] = p->kind == I8_ASYM ? lo + 128.0f * sv : lo;
        }
    }
}

/* ---------------------------------------------------------------- dots of a rows with code rows, per group */

#if VECTOR
/* A for the vector dot loops: per a row m, group g and chunk j, CH entries (int4 kinds: the chunk's even channels
 * in 0..15 and odd ones in 16..31, the order the nibbles come in; zeros past the chunk's width), int16 for the avx2
 * int8 kinds (sign-extended codes, madd), else int8. Returns the entry size; sums[m * G + g] = sum of a. */
static int prep_a(const int8_t *a, int64_t lda, int64_t rows, const part_t *p, void *out, int32_t *sums) {
    int wide = MLAQ_ISA == MLAQ_AVX2 && !SUB_BYTE(p->kind);
    int64_t G = p->groups;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t g = 0; g < G; g++) {
            int32_t sum = 0;
            for (int64_t j = 0; j < p->nch; j++) {
                int64_t at = ((m * G + g) * p->nch + j) * CH, c0 = g * p->gs + j * CH;
                int64_t w = p->gs - j * CH < CH ? p->gs - j * CH : CH;
                int16_t vals[CH] = {0};
                for (int64_t i = 0; i < w; i++) {
                    int8_t v = a[m * lda + c0 + i];
                    sum += v;
                    vals[IS_INT4(p->kind) ? ((i & 1) ? CH / 2 + i / 2 : i / 2) : i] = v;
                }
                for (int i = 0; i < CH; i++) {
                    if (wide) ((int16_t *)out)[at + i] = vals[i];
                    else ((int8_t *)out)[at + i] = (int8_t)vals[i];
                }
            }
            sums[m * G + g] = sum;
        }
    }
    return wide ? 2 : 1;
}

INLINE __m128i load16(const uint8_t *p, int64_t n) { /* n <= 16 bytes, zeros after */
    if (n == 16) return _mm_loadu_si128((const __m128i *)p);
    if (n == 8) return _mm_loadl_epi64((const __m128i *)p);
    int32_t i4;
    int16_t i2;
    if (n == 12) {
        memcpy(&i4, p + 8, 4);
        return _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)p), i4, 2);
    }
    if (n == 4 || n == 6) {
        memcpy(&i4, p, 4);
        if (n == 4) return _mm_cvtsi32_si128(i4);
        memcpy(&i2, p + 4, 2);
        return _mm_insert_epi16(_mm_cvtsi32_si128(i4), i2, 2);
    }
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)n);
    return _mm_loadu_si128((const __m128i *)tmp);
}

INLINE __m256i load32(const uint8_t *p, int64_t n) { /* n <= 32 bytes, zeros after */
    if (n == 32) return _mm256_loadu_si256((const __m256i *)p);
    if (n <= 16) return _mm256_zextsi128_si256(load16(p, n));
    return _mm256_set_m128i(load16(p + 16, n - 16), _mm_loadu_si128((const __m128i *)p));
}

INLINE __m256i nibbles(const uint8_t *p, int64_t nbytes) { /* [low nibbles | high nibbles] of nbytes <= 16 */
    __m256i x = _mm256_broadcastsi128_si256(load16(p, nbytes)); /* one shift and one mask for both halves */
    return _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

/* Bit-stream fields (3 or 2 bits): channel c at bits b.c .. b.c + b - 1. A 16-bit lane i of `fields16` takes the
 * byte pair holding channel c0 + i (pshufb on the bytes broadcast to both halves) and shifts its field to the top
 * with a multiply by 2^(16 - b - bit offset), then down by 16 - b: 16 channels per call, no variable shifts. */
#define FB(b, c) (char)(((c) * (b)) >> 3), (char)((((c) * (b)) >> 3) + 1)
#define FB8(b, c) FB(b, c), FB(b, c + 1), FB(b, c + 2), FB(b, c + 3), FB(b, c + 4), FB(b, c + 5), FB(b, c + 6), FB(b, c + 7)
#define FM(b, c) (short)(1 << (16 - (b) - (((c) * (b)) & 7)))
#define FM8(b, c) FM(b, c), FM(b, c + 1), FM(b, c + 2), FM(b, c + 3), FM(b, c + 4), FM(b, c + 5), FM(b, c + 6), FM(b, c + 7)
INLINE __m256i fields16(__m128i bytes, int bits, int half) { /* channels 16 * half .. 16 * half + 15 of the bytes */
    __m256i ctl, mul;
    if (bits == 3) {
        ctl = half ? _mm256_setr_epi8(FB8(3, 16), FB8(3, 24)) : _mm256_setr_epi8(FB8(3, 0), FB8(3, 8));
        mul = half ? _mm256_setr_epi16(FM8(3, 16), FM8(3, 24)) : _mm256_setr_epi16(FM8(3, 0), FM8(3, 8));
    } else {
        ctl = half ? _mm256_setr_epi8(FB8(2, 16), FB8(2, 24)) : _mm256_setr_epi8(FB8(2, 0), FB8(2, 8));
        mul = half ? _mm256_setr_epi16(FM8(2, 16), FM8(2, 24)) : _mm256_setr_epi16(FM8(2, 0), FM8(2, 8));
    }
    __m256i pairs = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), ctl);
    return _mm256_srli_epi16(_mm256_mullo_epi16(pairs, mul), 16 - bits);
}

INLINE __m256i stream_codes(const uint8_t *p, int64_t w, int bits) { /* w <= 32 unsigned codes, channel order */
    __m128i x = load16(p, (w * bits + 7) / 8);
    __m256i u = _mm256_packus_epi16(fields16(x, bits, 0), fields16(x, bits, 1)); /* 0-7 16-23 | 8-15 24-31 */
    return _mm256_permute4x64_epi64(u, 0xD8);
}

INLINE __m256i sub_byte_codes(int kind, const uint8_t *p, int64_t w) { /* unsigned codes of a sub-byte chunk */
    return IS_INT4(kind) ? nibbles(p, w / 2) : kind == U8_CODES ? load32(p, w) : stream_codes(p, w, BITS(kind));
}

INLINE int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

INLINE __m256i hsum8(const __m256i *v) { /* the 8 sums of v[0..7] */
    __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i a = _mm256_hadd_epi32(s01, s23), b = _mm256_hadd_epi32(s45, s67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The 8 x 8 transpose of r's 32-bit words: r[i] word j -> r[j] word i. */
INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i + j]: rows 4i..4i + 3 of words j | j + 4 */
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* acc[mi][ni] += the (uncorrected) dots of chunk j (w channels) of code rows r[ni] with A rows am + mi * astep. */
INLINE void chunk_dots(int kind, const uint8_t *am, int64_t astep, const uint8_t *const *r, int64_t j, int64_t w,
                       const int mt, const int nt, __m256i acc[DOT_MT][DOT_NT]) {
#if VNNI
    __m256i u[DOT_NT];
    _Pragma("GCC unroll 16")
    for (int ni = 0; ni < nt; ni++) {
        if (SUB_BYTE(kind)) u[ni] = sub_byte_codes(kind, r[ni] + j * CH * BITS(kind) / 8, w);
        else if (kind == I8_SYM) u[ni] = _mm256_xor_si256(load32(r[ni] + j * CH, w), _mm256_set1_epi8((char)0x80));
        else u[ni] = load32(r[ni] + j * CH, w);
    }
    _Pragma("GCC unroll 16")
    for (int mi = 0; mi < mt; mi++) {
        __m256i a = _mm256_load_si256((const __m256i *)(am + mi * astep));
        _Pragma("GCC unroll 16")
        for (int ni = 0; ni < nt; ni++) acc[mi][ni] = DPBUSD(acc[mi][ni], u[ni], a);
    }
#else
    /* int8 codes sign-extended to int16, 16 channels at a time (registers: 8 accumulators + 2 rows); sub-byte
     * codes: `sub_chunk_dots` */
    for (int half = 0; half < 2 && 16 * half < w; half++) {
        int64_t wh = w - 16 * half < 16 ? w - 16 * half : 16;
        __m256i x[DOT_NT];
        _Pragma("GCC unroll 16")
        for (int ni = 0; ni < nt; ni++) {
            __m128i b = load16(r[ni] + j * CH + 16 * half, wh);
            if (kind == I8_ASYM) b = _mm_xor_si128(b, _mm_set1_epi8((char)0x80));
            x[ni] = _mm256_cvtepi8_epi16(b);
        }
        _Pragma("GCC unroll 16")
        for (int mi = 0; mi < mt; mi++) {
            __m256i a = _mm256_load_si256((const __m256i *)(am + mi * astep + 32 * half));
            _Pragma("GCC unroll 16")
            for (int ni = 0; ni < nt; ni++) acc[mi][ni] = ADD32(acc[mi][ni], _mm256_madd_epi16(x[ni], a));
        }
    }
#endif
}

#if MLAQ_ISA == MLAQ_AVX2
/* avx2 sub-byte dots: maddubs pairs (|.| <= 2 * umax * 128) added in int16 over a run of SUB_RUN chunks
 * (SUB_RUN * 2 * umax * 128 <= 32768: no overflow), then one madd by ones into the INT32 sums per run, where a
 * madd per chunk had been as many multiplies as the maddubs themselves. */
#define SUB_RUN(kind) (BITS(kind) == 4 || (kind) == U8_CODES ? 8 : BITS(kind) == 3 ? 16 : 32) /* U8_CODES: <= 15 */
INLINE void sub_zero(const int mt, const int nt, __m256i a16[DOT_MT][DOT_NT]) {
    _Pragma("GCC unroll 16") for (int mi = 0; mi < mt; mi++)
        _Pragma("GCC unroll 16") for (int ni = 0; ni < nt; ni++) a16[mi][ni] = _mm256_setzero_si256();
}
INLINE void sub_fold(const int mt, const int nt, __m256i a16[DOT_MT][DOT_NT], __m256i acc[DOT_MT][DOT_NT]) {
    const __m256i ones = _mm256_set1_epi16(1);
    _Pragma("GCC unroll 16") for (int mi = 0; mi < mt; mi++)
        _Pragma("GCC unroll 16") for (int ni = 0; ni < nt; ni++)
            acc[mi][ni] = _mm256_add_epi32(acc[mi][ni], _mm256_madd_epi16(a16[mi][ni], ones));
}
/* a16[mi][ni] += maddubs(unsigned codes of chunk j (w channels) of row r[ni], A row am + mi * astep), int16 */
INLINE void sub_chunk_dots(int kind, const uint8_t *am, int64_t astep, const uint8_t *const *r, int64_t j, int64_t w,
                           const int mt, const int nt, __m256i a16[DOT_MT][DOT_NT]) {
    __m256i u[DOT_NT];
    _Pragma("GCC unroll 16")
    for (int ni = 0; ni < nt; ni++) u[ni] = sub_byte_codes(kind, r[ni] + j * CH * BITS(kind) / 8, w);
    _Pragma("GCC unroll 16")
    for (int mi = 0; mi < mt; mi++) {
        __m256i a = _mm256_load_si256((const __m256i *)(am + mi * astep));
        _Pragma("GCC unroll 16")
        for (int ni = 0; ni < nt; ni++) a16[mi][ni] = add16_into(a16[mi][ni], _mm256_maddubs_epi16(u[ni], a));
    }
}
#endif

/* out[mi * ld_m + ni] = dot of a rows m0 + mi (ap: A of row m0, rows astride entries apart) with code rows rows[ni]
 * over group g, less corr[mi * cstride] (wrapping); mt <= DOT_MT, nt <= DOT_NT (constants after inlining). */
INLINE void tile_dots(const part_t *p, const int kind, const uint8_t *ap, int64_t astride, int esize, int64_t g,
                      const uint8_t *const *rows, const int mt, const int nt, const uint32_t *corr, int64_t cstride,
                      int32_t *out, int64_t ld_m) {
    __m256i acc[DOT_MT][DOT_NT];
    _Pragma("GCC unroll 16")
    for (int mi = 0; mi < mt; mi++)
        _Pragma("GCC unroll 16")
        for (int ni = 0; ni < nt; ni++) acc[mi][ni] = _mm256_setzero_si256();
    const int64_t full = p->gs / CH, tail = p->gs % CH;
    const uint8_t *a0 = ap + g * p->nch * CH * esize, *r[DOT_NT];
    _Pragma("GCC unroll 16")
    for (int ni = 0; ni < nt; ni++) r[ni] = rows[ni] + g * p->gs * BITS(kind) / 8;
    /* full chunks at a constant width (the loads' branches fold away), then the group's short tail chunk */
#if MLAQ_ISA == MLAQ_AVX2
    if (SUB_BYTE(kind)) { /* int16 sums over runs of chunks, one madd per run: see `sub_chunk_dots` */
        const int64_t run = SUB_RUN(kind);
        for (int64_t j0 = 0; j0 < full; j0 += run) {
            __m256i a16[DOT_MT][DOT_NT];
            const int64_t j1 = full - j0 < run ? full : j0 + run;
            sub_zero(mt, nt, a16);
            for (int64_t j = j0; j < j1; j++) sub_chunk_dots(kind, a0 + j * CH, astride, r, j, CH, mt, nt, a16);
            sub_fold(mt, nt, a16, acc);
        }
        if (tail) {
            __m256i a16[DOT_MT][DOT_NT];
            sub_zero(mt, nt, a16);
            sub_chunk_dots(kind, a0 + full * CH, astride, r, full, tail, mt, nt, a16);
            sub_fold(mt, nt, a16, acc);
        }
    } else
#endif
    {
        for (int64_t j = 0; j < full; j++) chunk_dots(kind, a0 + j * CH * esize, astride * esize, r, j, CH, mt, nt, acc);
        if (tail) chunk_dots(kind, a0 + full * CH * esize, astride * esize, r, full, tail, mt, nt, acc);
    }
    if (mt * nt == 8 || mt * nt == 16) { /* 8 sums per vector, lanes mi * nt + ni; nt = 2 or 4 */
        __m256i flat[16];
        _Pragma("GCC unroll 16")
        for (int mi = 0; mi < mt; mi++)
            _Pragma("GCC unroll 16")
            for (int ni = 0; ni < nt; ni++) flat[mi * nt + ni] = acc[mi][ni];
        _Pragma("GCC unroll 16")
        for (int v = 0; v < mt * nt / 8; v++) {
            int m = v * 8 / nt; /* each lane's correction built in registers (no store-forwarding stall) */
            __m256i cv;
            if (nt == 4) {
                cv = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32((int)corr[m * cstride])),
                                             _mm_set1_epi32((int)corr[(m + 1) * cstride]), 1);
            } else {
                int c0 = (int)corr[0], c1 = (int)corr[cstride], c2 = (int)corr[2 * cstride], c3 = (int)corr[3 * cstride];
                cv = _mm256_setr_epi32(c0, c0, c1, c1, c2, c2, c3, c3);
            }
            __m256i sums = _mm256_sub_epi32(hsum8(flat + 8 * v), cv);
            __m128i lo = _mm256_castsi256_si128(sums), hi = _mm256_extracti128_si256(sums, 1);
            if (nt == 4) {
                _mm_storeu_si128((__m128i *)(out + m * ld_m), lo);
                _mm_storeu_si128((__m128i *)(out + (m + 1) * ld_m), hi);
            } else {
                _mm_storel_epi64((__m128i *)(out + m * ld_m), lo);
                _mm_storel_epi64((__m128i *)(out + (m + 1) * ld_m), _mm_unpackhi_epi64(lo, lo));
                _mm_storel_epi64((__m128i *)(out + (m + 2) * ld_m), hi);
                _mm_storel_epi64((__m128i *)(out + (m + 3) * ld_m), _mm_unpackhi_epi64(hi, hi));
            }
        }
    } else {
        _Pragma("GCC unroll 16")
        for (int mi = 0; mi < mt; mi++)
            _Pragma("GCC unroll 16")
            for (int ni = 0; ni < nt; ni++)
                out[mi * ld_m + ni] = (int32_t)((uint32_t)hsum(acc[mi][ni]) - corr[mi * cstride]);
    }
}

/* The bias the vector sums carry: `dots_rows`' VNNI int8 sums u8 = c' + 128 (-128 sum a), sub-byte sym codes
 * c' + BIAS; token-lane sums (lanes != 0) take int8 codes as c' itself (int16 words), so only the sub-byte BIAS. */
static void corrections(const part_t *p, const int32_t *sums, int64_t n, uint32_t *corr, int lanes) {
    uint32_t k = (VNNI && !lanes && !SUB_BYTE(p->kind)) ? 128u : (uint32_t)BIAS(p->kind);
    for (int64_t i = 0; i < n; i++) corr[i] = k * (uint32_t)sums[i];
}

/* out[g * ld_g + m * ld_m + ni] for every group g and a row m (rows of m_rows, A at ap) with the code rows
 * rows[0..nt): the head tiles and groups of one row tile in one call, the kind and nt constants inside. */
INLINE void head_tiles(const part_t *p, const int kind, const uint8_t *ap, int esize, const uint32_t *corr,
                       int64_t m_rows, const uint8_t *const *rows, const int nt, int32_t *out, int64_t ld_g,
                       int64_t ld_m) {
    const int64_t astride = p->groups * p->nch * CH;
    for (int64_t g = 0; g < p->groups; g++)
        for (int64_t m0 = 0; m0 < m_rows; m0 += DOT_MT) {
            const uint8_t *am = ap + m0 * astride * esize;
            const uint32_t *cg = corr + m0 * p->groups + g;
            int32_t *og = out + g * ld_g + m0 * ld_m;
            int64_t mt = m_rows - m0;
            if (mt >= 4) tile_dots(p, kind, am, astride, esize, g, rows, 4, nt, cg, p->groups, og, ld_m);
            else if (mt == 3) tile_dots(p, kind, am, astride, esize, g, rows, 3, nt, cg, p->groups, og, ld_m);
            else if (mt == 2) tile_dots(p, kind, am, astride, esize, g, rows, 2, nt, cg, p->groups, og, ld_m);
            else tile_dots(p, kind, am, astride, esize, g, rows, 1, nt, cg, p->groups, og, ld_m);
        }
}

/* `head_tiles`; bit-stream codes read by more than one head tile are unpacked once per row tile, to a byte each. */
INLINE void rows_dots(const part_t *p, const int kind, const uint8_t *ap, int esize, const uint32_t *corr,
                      int64_t m_rows, const uint8_t *const *rows, const int nt, int32_t *out, int64_t ld_g,
                      int64_t ld_m) {
    if ((kind != I3_SYM && kind != I2_SYM) || m_rows <= DOT_MT) {
        head_tiles(p, kind, ap, esize, corr, m_rows, rows, nt, out, ld_g, ld_m);
        return;
    }
    uint8_t ubuf[DOT_NT][p->width + CH]; /* a chunk's store may run CH bytes past a group's end */
    const uint8_t *urows[DOT_NT];
    _Pragma("GCC unroll 16")
    for (int ni = 0; ni < nt; ni++) {
        for (int64_t g = 0; g < p->groups; g++)
            for (int64_t j = 0; j < p->nch; j++) {
                int64_t c0 = g * p->gs + j * CH, w = p->gs - j * CH < CH ? p->gs - j * CH : CH;
                _mm256_storeu_si256((__m256i *)(ubuf[ni] + c0),
                                    stream_codes(rows[ni] + c0 * BITS(kind) / 8, w, BITS(kind)));
            }
        urows[ni] = ubuf[ni];
    }
    head_tiles(p, U8_CODES, ap, esize, corr, m_rows, urows, nt, out, ld_g, ld_m);
}

/* rows_dots of one kind and tile width, as a function of its own (its accumulators then stay in registers) */
#define ROWS_FN(KIND, NT) ROWS_FN_(KIND, NT) /* (expands DOT_NT before pasting) */
#define ROWS_FN_(KIND, NT)                                                                                        \
    static __attribute__((noinline)) void rows_##KIND##_##NT(const part_t *p, const uint8_t *ap, int esize,      \
                                                              const uint32_t *corr, int64_t m_rows,               \
                                                              const uint8_t *const *rows, int32_t *out,           \
                                                              int64_t ld_g, int64_t ld_m) {                       \
        rows_dots(p, KIND, ap, esize, corr, m_rows, rows, NT, out, ld_g, ld_m);                                   \
    }
ROWS_FN(I8_SYM, DOT_NT)
ROWS_FN(I8_ASYM, DOT_NT)
ROWS_FN(I4_SYM, DOT_NT)
ROWS_FN(I4_ASYM, DOT_NT)
ROWS_FN(I3_SYM, DOT_NT)
ROWS_FN(I2_SYM, DOT_NT)
ROWS_FN(I8_SYM, 1)
ROWS_FN(I8_ASYM, 1)
ROWS_FN(I4_SYM, 1)
ROWS_FN(I4_ASYM, 1)
ROWS_FN(I3_SYM, 1)
ROWS_FN(I2_SYM, 1)

INLINE void dots_rows_vec(const part_t *p, const uint8_t *ap, int esize, const uint32_t *corr, int64_t m_rows,
                          const uint8_t *const *rows, int nt, int32_t *out, int64_t ld_g, int64_t ld_m) {
#define ROWS_CALL(NT, R, O)                                                                                       \
    switch (p->kind) {                                                                                            \
    case I8_SYM: rows_I8_SYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m); break;                           \
    case I8_ASYM: rows_I8_ASYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m); break;                         \
    case I4_SYM: rows_I4_SYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m); break;                           \
    case I4_ASYM: rows_I4_ASYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m); break;                         \
    case I3_SYM: rows_I3_SYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m); break;                           \
    default: rows_I2_SYM_##NT(p, ap, esize, corr, m_rows, R, O, ld_g, ld_m);                                      \
    }
    if (nt == DOT_NT) {
#if DOT_NT == 4
        ROWS_CALL(4, rows, out)
#else
        ROWS_CALL(2, rows, out)
#endif
    } else {
        for (int ni = 0; ni < nt; ni++) {
            ROWS_CALL(1, rows + ni, out + ni)
        }
    }
#undef ROWS_CALL
}
#endif

/* The dots of every a row (m rows) with code rows rows[0..nt) into out[g * ld_g + m * ld_m + ni]. */
typedef struct {
    const part_t *p;
    const int8_t *a;
    int64_t lda, m;
    const uint8_t *ap;
    int esize;
    const uint32_t *corr;
} dotter_t;

static void dots_rows(const dotter_t *d, const uint8_t *const *rows, int nt, int32_t *out, int64_t ld_g, int64_t ld_m) {
#if !VECTOR
    const part_t *p = d->p;
    int16_t codes[DOT_NT][p->width]; /* each row's codes c' decoded once, for every a row */
    for (int ni = 0; ni < nt; ni++)
        for (int64_t c = 0; c < p->width; c++) codes[ni][c] = (int16_t)code_at(rows[ni], p->kind, c);
    for (int64_t m = 0; m < d->m; m++)
        for (int64_t g = 0; g < p->groups; g++)
            for (int ni = 0; ni < nt; ni++) {
                uint32_t sum = 0; /* wrapping: exact wherever the result fits in int32 */
                for (int64_t c = g * p->gs; c < (g + 1) * p->gs; c++)
                    sum += (uint32_t)((int32_t)d->a[m * d->lda + c] * codes[ni][c]);
                out[g * ld_g + m * ld_m + ni] = (int32_t)sum;
            }
#else
    dots_rows_vec(d->p, d->ap, d->esize, d->corr, d->m, rows, nt, out, ld_g, ld_m);
#endif
}

/* A prepared for `dots_rows` (vector variants), freed by `dotter_free`. */
static dotter_t dotter_make(const part_t *p, const int8_t *a, int64_t lda, int64_t m) {
    dotter_t d = {p, a, lda, m, NULL, 1, NULL};
#if VECTOR
    int64_t n = m * p->groups;
    uint8_t *ap = alloc((size_t)(n * p->nch * CH * 2));
    int32_t *sums = alloc((size_t)n * 4);
    uint32_t *corr = alloc((size_t)n * 4);
    d.esize = prep_a(a, lda, m, p, ap, sums);
    corrections(p, sums, n, corr, 0);
    free(sums);
    d.ap = ap;
    d.corr = corr;
#endif
    return d;
}

static void dotter_free(dotter_t *d) {
    free((void *)d->ap);
    free((void *)d->corr);
}

/* sum_k a[m][k] over each group: [m][G] */
static void a_sums(const part_t *p, const int8_t *a, int64_t lda, int64_t m, int32_t *sums) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < p->groups; g++) {
            int32_t s = 0;
            for (int64_t c = g * p->gs; c < (g + 1) * p->gs; c++) s += a[i * lda + c];
            sums[i * p->groups + g] = s;
        }
}

/* c[b][m][n] = sum_k a[b][m][k] * c'(w row n of batch b, k) (one group of k channels), int32. */
void mlaq_dots(const int8_t *a, int64_t lda_b, int64_t lda_m, int64_t m, int kind, const uint8_t *w, int64_t ldw_b,
               int64_t ldw_n, int64_t n, int64_t k, int32_t *c, int64_t ldc_b, int64_t ldc_m, int64_t batch,
               int threads) {
    part_t p = make_part(kind, k, k, 0, 0);
    dotter_t *d = malloc(sizeof(dotter_t) * (size_t)batch);
    for (int64_t b = 0; b < batch; b++) d[b] = dotter_make(&p, a + b * lda_b, lda_m, m);
    int64_t tiles = (n + DOT_NT - 1) / DOT_NT, jobs = batch * tiles;
#pragma omp parallel for num_threads(jobs < threads ? (int)(jobs > 0 ? jobs : 1) : threads) schedule(static)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t b = job / tiles, n0 = (job % tiles) * DOT_NT;
        int nt = n - n0 < DOT_NT ? (int)(n - n0) : DOT_NT;
        const uint8_t *rows[DOT_NT];
        for (int ni = 0; ni < nt; ni++) rows[ni] = w + b * ldw_b + (n0 + ni) * ldw_n;
        dots_rows(&d[b], rows, nt, c + b * ldc_b + n0, 0, ldc_m);
    }
    for (int64_t b = 0; b < batch; b++) dotter_free(&d[b]);
    free(d);
}

/* ---------------------------------------------------------------- W8A8 on packed weights */

/* The W8A8 product of `mlaquant.modeling.int8_proj.Int8Weight` in one call. x fp32 [M][G][K]: per (m, g) row
 * amax = max |x|, codes rint(x * ((1 / amax) * 127)) clamped to +-127 (0 where amax == 0; torch's 127.0 / amax is
 * reciprocal(amax) * 127), s_x = amax / 127. Weights packed once (`native.pack_w8`): wp int8
 * [G][Np / 8][K4 / 4][8][4] (Np = N rounded up to 16, K4 = K rounded up to 4, zeros past N and K; codes in +-127),
 * so one 32-byte load is 4 consecutive channels of 8 outputs; wsp fp32 [G][Np] (zeros past N). acc = exact INT32
 * sums; out fp32 [M][G][N] = ((float)acc * s_x) * ws[g][n], the FP32 operations of the torch route in its order.
 * Vector forms: a broadcast 4-channel word of |codes| times w carrying the activation's sign (_mm256_sign_epi8),
 * _mm256_maddubs_epi16 + _mm256_madd_epi16 (pairs at most 2 * 127 * 127: no saturation; VNNI: vpdpbusd), 8 outputs
 * per accumulator lane-wise, so no horizontal sum. */
#define W8_MT 4  /* activation rows per tile */
#define W8_JOB 4 /* 16-output block pairs per job */

/* max |x| of n finite floats, as the bits of |x|: ordered like the values, and an integer max reduction
 * vectorizes where a float one does not without -ffast-math (a max: the same value in any order) */
static float absmax(const float *x, int64_t n) {
    uint32_t abits = 0;
    for (int64_t c = 0; c < n; c++) {
        uint32_t b;
        memcpy(&b, x + c, 4);
        b &= 0x7fffffffu;
        abits = b > abits ? b : abits;
    }
    float amax;
    memcpy(&amax, &abits, 4);
    return amax;
}

/* int8 codes of already scaled values: clamp(rint(v), +-127), rint half to even (the current rounding mode) */
static inline int8_t code_of(float v) {
    v = nearbyintf(v);
    v = v > 127.0f ? 127.0f : v;
    return (int8_t)(v < -127.0f ? -127.0f : v);
}
#if VECTOR
/* `code_of` of 8 lanes, in the low 8 bytes */
INLINE __m128i codes8_of(__m256 v) {
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i i = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, hi), lo));
    __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    return _mm_packs_epi16(i16, i16);
}
#endif

/* One activation row's codes a[k4], |codes| u[k4] (zeros past k) and its scale. */
static void w8a8_quantize_row(const float *xr, int64_t k, int64_t k4, int8_t *a, uint8_t *u, float *sx) {
    const float amax = absmax(xr, k);
    float inv = amax > 0.0f ? (1.0f / amax) * 127.0f : 0.0f;
    int64_t c = 0;
#if VECTOR
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; c + 8 <= k; c += 8) { /* the scalar loop's operations, 8 lanes at a time */
        __m128i v8 = codes8_of(_mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv));
        _mm_storel_epi64((__m128i *)(a + c), v8);
        _mm_storel_epi64((__m128i *)(u + c), _mm_abs_epi8(v8));
    }
#endif
    for (; c < k; c++) {
        int32_t code = code_of(xr[c] * inv);
        a[c] = (int8_t)code;
        u[c] = (uint8_t)(code < 0 ? -code : code);
    }
    for (c = k; c < k4; c++) a[c] = 0, u[c] = 0;
    *sx = amax / 127.0f;
}

/* acc[i][b] (8 int32 lanes: outputs 8b..8b+7 of the pair) = sum over kq channel quads of row i's codes with the
 * pair's two packed blocks (w: the first block, the second kq * 32 bytes on), for mt rows lda bytes apart. */
#if VECTOR
INLINE void w8a8_tile(const int8_t *a, const uint8_t *u, int64_t lda, int mt, const int8_t *w, int64_t kq,
                      __m256i acc[W8_MT][2]) {
#if !VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256i c[W8_MT][2]; /* local: the stores to acc would otherwise follow every byte load (char aliasing) */
    for (int i = 0; i < mt; i++) c[i][0] = c[i][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < kq; q++) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + q * 32));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (kq + q) * 32));
        for (int i = 0; i < mt; i++) {
            int32_t sa, ua;
            memcpy(&sa, a + i * lda + 4 * q, 4);
            memcpy(&ua, u + i * lda + 4 * q, 4);
            __m256i s = _mm256_set1_epi32(sa), uv = _mm256_set1_epi32(ua);
            __m256i p0 = _mm256_sign_epi8(w0, s), p1 = _mm256_sign_epi8(w1, s);
#if VNNI
            c[i][0] = DPBUSD(c[i][0], uv, p0);
            c[i][1] = DPBUSD(c[i][1], uv, p1);
#else
            c[i][0] = _mm256_add_epi32(c[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(uv, p0), ones));
            c[i][1] = _mm256_add_epi32(c[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(uv, p1), ones));
#endif
        }
    }
    for (int i = 0; i < mt; i++) acc[i][0] = c[i][0], acc[i][1] = c[i][1];
}
#define W8A8_TILE(MT)                                                                                                 \
    static __attribute__((noinline)) void w8a8_tile_##MT(const int8_t *a, const uint8_t *u, int64_t lda,           \
                                                         const int8_t *w, int64_t kq, __m256i acc[W8_MT][2]) {     \
        w8a8_tile(a, u, lda, MT, w, kq, acc);                                                                      \
    }
W8A8_TILE(1)
W8A8_TILE(2)
W8A8_TILE(3)
W8A8_TILE(4)
#endif

/* out rows i0..i0+mt of group g, outputs n0..n0+15 (those below n): the tile's sums through the epilogue. */
static void w8a8_pair(const int8_t *a, const uint8_t *u, int64_t lda, int mt, const int8_t *w, int64_t kq,
                      const float *ws, const float *sx, int64_t sx_ld, int64_t n0, int64_t n, float *out,
                      int64_t ld_out) {
    int64_t valid = n - n0 < 16 ? n - n0 : 16;
#if VECTOR
    __m256i acc[W8_MT][2];
    switch (mt) {
    case 1: w8a8_tile_1(a, u, lda, w, kq, acc); break;
    case 2: w8a8_tile_2(a, u, lda, w, kq, acc); break;
    case 3: w8a8_tile_3(a, u, lda, w, kq, acc); break;
    default: w8a8_tile_4(a, u, lda, w, kq, acc); break;
    }
    for (int i = 0; i < mt; i++) {
        __m256 s = _mm256_set1_ps(sx[i * sx_ld]);
        float row[16];
        for (int b = 0; b < 2; b++) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][b]), s), _mm256_loadu_ps(ws + 8 * b));
            if (valid == 16)
                _mm256_storeu_ps(out + i * ld_out + 8 * b, v);
            else
                _mm256_storeu_ps(row + 8 * b, v);
        }
        if (valid < 16) memcpy(out + i * ld_out, row, (size_t)valid * 4);
    }
#else
    (void)u;
    for (int i = 0; i < mt; i++)
        for (int64_t j = 0; j < valid; j++) {
            const int8_t *wb = w + (j / 8) * kq * 32 + (j % 8) * 4;
            int32_t acc = 0;
            for (int64_t q = 0; q < kq; q++)
                for (int c = 0; c < 4; c++) acc += (int32_t)a[i * lda + 4 * q + c] * wb[q * 32 + c];
            out[i * ld_out + j] = ((float)acc * sx[i * sx_ld]) * ws[j];
        }
#endif
}

void mlaq_w8a8(const float *x, int64_t m, int64_t groups, int64_t k, const int8_t *wp, int64_t n, const float *wsp,
               float *out, int threads) {
    int64_t k4 = (k + 3) / 4 * 4, kq = k4 / 4, np = (n + 15) / 16 * 16, pairs = np / 16, rows = m * groups;
    int8_t *a = scratch(SC_W8_CODES, (size_t)(rows * k4));
    uint8_t *u = scratch(SC_W8_ABS, (size_t)(rows * k4));
    float *sx = scratch(SC_W8_SCALE, (size_t)rows * 4);
    int64_t chunks = (pairs + W8_JOB - 1) / W8_JOB, jobs = groups * chunks;
    int nth = jobs < threads ? (int)jobs : threads;
#pragma omp parallel num_threads(nth > 0 ? nth : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) w8a8_quantize_row(x + r * k, k, k4, a + r * k4, u + r * k4, sx + r);
#pragma omp for schedule(static)
        for (int64_t job = 0; job < jobs; job++) {
            int64_t g = job / chunks, p0 = (job % chunks) * W8_JOB, p1 = p0 + W8_JOB < pairs ? p0 + W8_JOB : pairs;
            for (int64_t pr = p0; pr < p1; pr++) {
                const int8_t *w = wp + (g * np + pr * 16) * k4;
                for (int64_t i0 = 0; i0 < m; i0 += W8_MT) {
                    int mt = m - i0 < W8_MT ? (int)(m - i0) : W8_MT;
                    int64_t r0 = i0 * groups + g;
                    w8a8_pair(a + r0 * k4, u + r0 * k4, groups * k4, mt, w, kq, wsp + g * np + pr * 16, sx + r0,
                              groups, pr * 16, n, out + r0 * n + pr * 16, groups * n);
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- the query's quantization */

/* The query of one integer part, as `cpu_decode.quantize_query` computes it (the Triton kernel's), bit for bit: per
 * row r < rows (x + r * ldx, width channels) and group g of gs channels, amax = max |x|, s = amax / 127 (1 where
 * amax is not > 0), q8 = clamp(rint(x / s), +-127) (rint: half to even), and qs[r][g] = s * factor (the score factor
 * folded in); q8 [rows][width], qs [rows][width / gs]. Finite x: IEEE division and multiplication in FP32, so every
 * variant and torch give the same bits. */
void mlaq_quantize(const float *x, int64_t rows, int64_t ldx, int64_t width, int64_t gs, float factor, int8_t *q8,
                   float *qs) {
    const int64_t G = width / gs;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + r * ldx + g * gs;
            int8_t *og = q8 + r * width + g * gs;
            const float amax = absmax(xg, gs), s = amax > 0.0f ? amax / 127.0f : 1.0f;
            int64_t c = 0;
#if VECTOR
            const __m256 vs = _mm256_set1_ps(s);
            for (; c + 8 <= gs; c += 8)
                _mm_storel_epi64((__m128i *)(og + c), codes8_of(_mm256_div_ps(_mm256_loadu_ps(xg + c), vs)));
#endif
            for (; c < gs; c++) og[c] = code_of(xg[c] / s);
            qs[r * G + g] = s * factor;
        }
}

/* ---------------------------------------------------------------- scores */

#define MAX_PARTS 8 /* a band c_kv part is one part per stored band, then k_pe */

/* One integer part of a scores call: where it starts in the row, its A, and per-thread buffers. */
typedef struct {
    part_t p;
    int64_t offset;
    dotter_t d;
    const float *qs;
    float *qlo;
    const uint8_t *lanes_q; /* token-lane query words (NULL: `dots_rows`): q8 [heads][width] itself (sub-byte
                               kinds) or lanes_q16 (int8 kinds) */
    int16_t *lanes_q16;     /* q8 as int16 [heads][width] (token-lane int8 kinds), else NULL */
    uint32_t *lanes_corr;   /* [heads][G]: the stored codes' offset times the group's q8 sum (`corrections`) */
} scored_t;

#if LANES
/* Token-lane scores. The dots of `dots_rows` leave every (head, row) sum across the lanes of a vector, and
 * their horizontal reduction costs as much as a 64-channel part's MACs: the bands of a band codec and k_pe paid it
 * once per 2-4 chunks. Here a block of TB rows is packed once, for every head, into words of 4 codes (sub-byte kinds,
 * unsigned as stored) or 2 codes (int8 kinds, c' as int16) with the tokens across the lanes: B[word][token]. A
 * head's query word (its 4 int8 / 2 int16 channels) broadcast against a vector of B gives 8 tokens' partial dots in
 * 8 lanes, so the sums come out token-wise with no reduction, into the same dots buffer `part_epilogue` reads: the
 * same integers, the same FP32 operations, the same bits. The VNNI variants take each step in one instruction
 * (vpdpbusd on 4 unsigned codes, vpdpwssd on 2 int16 ones, into the INT32 sums); avx2 in maddubs / madd (LANE_FN). */

/* Whether part p runs token-lane: its groups whole words (4 channels sub-byte, 2 int8) of at most LANES_MAX
 * channels, where `dots_rows`' reduction is not amortized over their chunks (bands, k_pe, g32 / g64 groups); a wide
 * row-wise part, sub-byte or int8, measured faster in `dots_rows` (A / B in docs/results/cpu-history.md). On VNNI only sub-byte
 * kinds: `dots_rows` takes int8 codes 4 to a vpdpbusd, twice the token-lane int16 pairs' vpdpwssd, and measured
 * faster (docs/results/cpu-history.md, Round 13). */
#define LANES_MAX 128
static int token_lanes(const part_t *p) {
    if (p->kind == U8_CODES || (VNNI && !SUB_BYTE(p->kind)) || p->gs % (SUB_BYTE(p->kind) ? 4 : 2)) return 0;
    return p->gs <= LANES_MAX;
}

/* Channels 32j .. 32j + w - 1 (w <= 32, zeros after) of a row's codes as words: sub-byte kinds 8 words of 4 unsigned
 * codes in channel order (w[0]); int8 kinds c' as 16 words of 2 int16 (w[0] channels 0..15, w[1] 16..31). */
INLINE void row_words(const int kind, const uint8_t *row, int64_t j, int64_t w, __m256i words[2]) {
    if (IS_INT4(kind)) {
        __m128i x = load16(row + 16 * j, (w + 1) / 2), m = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
        words[0] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    } else if (SUB_BYTE(kind)) {
        words[0] = stream_codes(row + j * CH * BITS(kind) / 8, w, BITS(kind));
    } else {
        __m128i a = load16(row + 32 * j, w < 16 ? w : 16), b = w > 16 ? load16(row + 32 * j + 16, w - 16) : _mm_setzero_si128();
        if (kind == I8_ASYM) {
            a = _mm_xor_si128(a, _mm_set1_epi8((char)0x80));
            b = _mm_xor_si128(b, _mm_set1_epi8((char)0x80));
        }
        words[0] = _mm256_cvtepi8_epi16(a);
        words[1] = _mm256_cvtepi8_epi16(b);
    }
}

/* B[word * TB + i] = word `word` of row i < nr (zeros for nr <= i < TB), every word of the part's codes; one
 * function per kind (the loads' branches fold away, the 8 rows' words stay in registers). */
INLINE void pack_lanes(const part_t *p, const int kind, const uint8_t *const *rows, int nr, int32_t *B) {
    const int per = SUB_BYTE(kind) ? 1 : 2; /* vectors of 8 words per 32-channel chunk */
    for (int64_t j = 0; 32 * j < p->width; j++) {
        int64_t w = p->width - 32 * j < 32 ? p->width - 32 * j : 32;
        for (int half = 0; half < TB / 8; half++) {
            __m256i v[2][8];
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                v[0][i] = v[1][i] = _mm256_setzero_si256();
                if (8 * half + i < nr) {
                    __m256i x[2];
                    row_words(kind, rows[8 * half + i], j, w, x);
                    v[0][i] = x[0];
                    if (per == 2) v[1][i] = x[1];
                }
            }
            for (int k = 0; k < per; k++) {
                transpose8(v[k]);
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)
                    _mm256_store_si256((__m256i *)(B + ((j * per + k) * 8 + i) * TB + 8 * half), v[k][i]);
            }
        }
    }
}
#define PACK_FN(KIND)                                                                                             \
    static __attribute__((noinline)) void pack_##KIND(const part_t *p, const uint8_t *const *rows, int nr,        \
                                                       int32_t *B) {                                              \
        pack_lanes(p, KIND, rows, nr, B);                                                                         \
    }
PACK_FN(I8_SYM)
PACK_FN(I8_ASYM)
PACK_FN(I4_SYM)
PACK_FN(I3_SYM)
PACK_FN(I2_SYM)
static void pack_token_lanes(const part_t *p, const uint8_t *const *rows, int nr, int32_t *B) {
    switch (p->kind) {
    case I8_SYM: pack_I8_SYM(p, rows, nr, B); break;
    case I8_ASYM: pack_I8_ASYM(p, rows, nr, B); break;
    case I3_SYM: pack_I3_SYM(p, rows, nr, B); break;
    case I2_SYM: pack_I2_SYM(p, rows, nr, B); break;
    default: pack_I4_SYM(p, rows, nr, B); /* int4 sym and asym: the same unsigned nibbles */
    }
}

/* acc + the dot of one word of 8 tokens (b) with a broadcast query word (q): sub-byte codes (u <= 15) 4 unsigned
 * codes by 4 int8 channels, int8 kinds 2 int16 by 2 int16. avx2: maddubs pairs (|.| <= 2 * 15 * 128) into int16
 * sums, folded into INT32 by `LANE_FOLD` once per run; int8 pairs madd straight into INT32. VNNI: INT32 directly. */
INLINE __m256i lane_mac(__m256i acc, __m256i b, __m256i q, const int sub) {
#if VNNI
    return sub ? DPBUSD(acc, b, q) : DPWSSD(acc, b, q);
#else
    return sub ? add16_into(acc, _mm256_maddubs_epi16(b, q)) : add32_into(acc, _mm256_madd_epi16(b, q));
#endif
}
#define LANE_FOLD (!VNNI) /* sub-byte int16 sums to fold into INT32 after each run (avx2) */

/* out[mi * ldo + i] = sum over words [c0, c1) of B[word * TB + i] . the query word of head mi (qw + mi * ldq
 * bytes, word c at byte 4c), less corr[mi * cstride] (wrapping), for the 8 tokens i of B's vector (B points at it)
 * and MT heads (`lane_mac`); avx2 sub-byte sums in int16 over runs of `run` words (run * 2 * umax * 128 <= 32768: no
 * overflow), then one madd by ones into the INT32 sums. One vector of tokens per pass keeps the MT sums, B's word
 * and the query words in registers (two vectors spilled a sum). */
#define LANE_FN(NAME, SUB, MT)                                                                                    \
    static __attribute__((noinline)) void NAME(const int32_t *B, int64_t c0, int64_t c1, const uint8_t *qw,       \
                                               int64_t ldq, int64_t run, const uint32_t *corr, int64_t cstride,   \
                                               int32_t *out, int64_t ldo) {                                       \
        __m256i acc[MT], sum[MT];                                                                                 \
        const __m256i ones = _mm256_set1_epi16(1);                                                                \
        _Pragma("GCC unroll 4") for (int mi = 0; mi < MT; mi++) acc[mi] = sum[mi] = _mm256_setzero_si256();      \
        for (int64_t r0 = c0; r0 < c1; r0 += run) {                                                               \
            int64_t r1 = c1 - r0 < run ? c1 : r0 + run;                                                           \
            for (int64_t c = r0; c < r1; c++) {                                                                   \
                __m256i b = _mm256_load_si256((const __m256i *)(B + c * TB));                                    \
                _Pragma("GCC unroll 4") for (int mi = 0; mi < MT; mi++) {                                         \
                    int32_t word;                                                                                 \
                    memcpy(&word, qw + mi * ldq + 4 * c, 4);                                                      \
                    __m256i q = _mm256_set1_epi32(word);                                                          \
                    acc[mi] = lane_mac(acc[mi], b, q, SUB);                                                       \
                }                                                                                                 \
            }                                                                                                     \
            if (SUB && LANE_FOLD) _Pragma("GCC unroll 4") for (int mi = 0; mi < MT; mi++) {                       \
                    sum[mi] = _mm256_add_epi32(sum[mi], _mm256_madd_epi16(acc[mi], ones));                        \
                    acc[mi] = _mm256_setzero_si256();                                                             \
                }                                                                                                 \
        }                                                                                                         \
        _Pragma("GCC unroll 4") for (int mi = 0; mi < MT; mi++)                                                   \
            _mm256_storeu_si256((__m256i *)(out + mi * ldo),                                                      \
                                _mm256_sub_epi32(SUB && LANE_FOLD ? sum[mi] : acc[mi],                    \
                                                 _mm256_set1_epi32((int)corr[mi * cstride])));                   \
    }
LANE_FN(lanes_sub_4, 1, 4)
LANE_FN(lanes_sub_1, 1, 1)
LANE_FN(lanes_i8_4, 0, 4)
LANE_FN(lanes_i8_1, 0, 1)

/* Part sp's INT32 dots of one tile token-lane (comment above) into dbuf [G][heads][TT], as `dots_rows` gives them:
 * rows[0..nt) the tile's rows, B a TB-row buffer of the part's words. */
static void part_lanes(const scored_t *sp, const uint8_t *const *rows, int64_t nt, int64_t heads, int32_t *dbuf,
                       int32_t *B) {
    const uint8_t *prow[TB];
    const part_t *p = &sp->p;
    const int sub = SUB_BYTE(p->kind), wpg = p->gs / (sub ? 4 : 2); /* words per group */
    const int64_t G = p->groups, ldq = p->width * (sub ? 1 : 2);
    const int64_t run = BITS(p->kind) == 4 ? 8 : BITS(p->kind) == 3 ? 16 : 32; /* int16 sums: see LANE_FN */
    for (int64_t tb = 0; tb < nt; tb += TB) {
        int nr = nt - tb < TB ? (int)(nt - tb) : TB;
        for (int i = 0; i < nr; i++) prow[i] = rows[tb + i] + sp->offset;
        pack_token_lanes(p, prow, nr, B);
        for (int64_t g = 0; g < G; g++)
            for (int64_t h0 = 0; h0 < heads; h0 += 4) {
                int mt = heads - h0 < 4 ? (int)(heads - h0) : 4;
                const uint8_t *qw = sp->lanes_q + h0 * ldq;
                const uint32_t *corr = sp->lanes_corr + h0 * G + g;
                for (int v = 0; 8 * v < nr; v++) {
                    const int32_t *Bv = B + 8 * v;
                    int32_t *o = dbuf + (g * heads + h0) * TT + tb + 8 * v; /* TT columns: room for a padded vector */
                    if (mt == 4) (sub ? lanes_sub_4 : lanes_i8_4)(Bv, g * wpg, (g + 1) * wpg, qw, ldq, run, corr, G, o, TT);
                    else
                        for (int mi = 0; mi < mt; mi++)
                            (sub ? lanes_sub_1 : lanes_i8_1)(Bv, g * wpg, (g + 1) * wpg, qw + mi * ldq, ldq, run,
                                                             corr + mi * G, G, o + mi * TT, TT);
                }
            }
    }
}
#endif

/* Part k's FP32 sums of `scores_tile` from its INT32 dots dbuf [G][heads][TT]: per head and token, v = (first ? 0 :
 * out), v += (qs[h][g] * s[t][g]) * dot (+ (asym) qlo[h][g] * zp[t][g]) group by group, out = v. */
static void part_epilogue(const scored_t *sp, const int32_t *dbuf, const float *s, const float *z, int64_t t0,
                          int64_t nt, int64_t heads, float *out, int64_t ldo, int first) {
    const int64_t G = sp->p.groups;
    const float *qs = sp->qs, *qlo = sp->qlo;
    for (int64_t h = 0; h < heads; h++) {
        float *o = out + h * ldo + t0;
        int64_t tt = 0;
#if VECTOR
        for (; tt + 8 <= nt; tt += 8) {
            __m256 v = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + tt);
            for (int64_t g = 0; g < G; g++) {
                __m256i di = _mm256_loadu_si256((const __m256i *)(dbuf + (g * heads + h) * TT + tt));
                v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(qs[h * G + g]), _mm256_loadu_ps(s + g * TT + tt)),
                                                   _mm256_cvtepi32_ps(di)));
                if (IS_ASYM(sp->p.kind))
                    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(qlo[h * G + g]), _mm256_loadu_ps(z + g * TT + tt)));
            }
            _mm256_storeu_ps(o + tt, v);
        }
#endif
        for (; tt < nt; tt++) {
            float v = first ? 0.0f : o[tt];
            for (int64_t g = 0; g < G; g++) {
                v = v + (qs[h * G + g] * s[g * TT + tt]) * (float)dbuf[(g * heads + h) * TT + tt];
                if (IS_ASYM(sp->p.kind)) v = v + qlo[h * G + g] * z[g * TT + tt];
            }
            o[tt] = v;
        }
    }
}

/* v (+)= sum over the parts, in order, of sum_g (qs[h][g] * s[t][g]) * dot + (asym) qlo[h][g] * zp[t][g], for the
 * tokens [t0, t0 + nt) of one tile, part by part (each part's sums stored and read back: exact); dbuf[k], sT[k], zT[k]
 * are part k's dots [G][heads][TT] and params [G][TT]; a part with `lanes_q` takes its dots token-lane, in lanes_b
 * (every vector variant). */
static void scores_tile(const scored_t *parts, int nparts, const uint8_t *base, const int64_t *pages,
                        int64_t page_rows, int64_t stride, int64_t t0, int64_t nt, int64_t heads, float *out,
                        int64_t ldo, int accumulate, int32_t **dbuf, float **sT, float **zT, int32_t *lanes_b) {
    const uint8_t *rows[TT], *prow[TT];
    rows_from(base, pages, page_rows, stride, t0, nt, rows);
    for (int k = 0; k < nparts; k++) {
        for (int64_t tt = 0; tt < nt; tt++) {
            prow[tt] = rows[tt] + parts[k].offset;
            load_params(&parts[k].p, prow[tt], sT[k] + tt, zT[k] + tt, TT);
        }
#if LANES
        if (parts[k].lanes_q) part_lanes(&parts[k], rows, nt, heads, dbuf[k], lanes_b);
        else
#else
        (void)lanes_b;
#endif
            for (int64_t tt = 0; tt < nt; tt += DOT_NT) {
                int n = nt - tt < DOT_NT ? (int)(nt - tt) : DOT_NT;
                dots_rows(&parts[k].d, prow + tt, n, dbuf[k] + tt, heads * TT, TT);
            }
        part_epilogue(&parts[k], dbuf[k], sT[k], zT[k], t0, nt, heads, out, ldo, !accumulate && k == 0);
    }
}

/* out[h][t] (+)= the scores of nparts <= MAX_PARTS integer parts of the same n block rows (module comment), in order:
 * desc[6k..6k+5] = kind, width, group size, scale and zero offsets (from the part's start), the part's byte
 * offset in the row; q8[k] [heads][width] int8, qs[k] [heads][groups] fp32 (score factor folded in); out
 * [heads][ldo] fp32. Parts in one call give the bits of one call per part, the later ones accumulating. */
void mlaq_scores(const uint8_t *base, const int64_t *pages, int64_t page_rows, int64_t stride, int64_t n, int nparts,
                 const int64_t *desc, const int8_t *const *q8, const float *const *qs, int64_t heads, float *out,
                 int64_t ldo, int accumulate, float *maxes, int threads) {
    scored_t parts[MAX_PARTS];
    nparts = nparts < MAX_PARTS ? nparts : MAX_PARTS;
    for (int k = 0; k < nparts; k++) {
        const int64_t *e = desc + 6 * k;
        scored_t *sp = &parts[k];
        sp->p = make_part((int)e[0], e[1], e[2], e[3], e[4]);
        sp->offset = e[5];
        sp->qs = qs[k];
        int64_t hg = heads * sp->p.groups;
        int32_t *sums = alloc((size_t)hg * 4);
        sp->qlo = alloc((size_t)hg * 4);
        a_sums(&sp->p, q8[k], sp->p.width, heads, sums);
        for (int64_t i = 0; i < hg; i++) sp->qlo[i] = (float)sums[i] * qs[k][i];
        sp->d = (dotter_t){0};
        sp->lanes_q = NULL;
        sp->lanes_q16 = NULL;
        sp->lanes_corr = NULL;
#if LANES
        if (token_lanes(&sp->p)) {
            sp->lanes_corr = alloc((size_t)hg * 4);
            corrections(&sp->p, sums, hg, sp->lanes_corr, 1);
            sp->lanes_q = (const uint8_t *)q8[k];
            if (!SUB_BYTE(sp->p.kind)) {
                int64_t hw = heads * sp->p.width;
                sp->lanes_q16 = alloc((size_t)hw * 2);
                for (int64_t i = 0; i < hw; i++) sp->lanes_q16[i] = q8[k][i];
                sp->lanes_q = (const uint8_t *)sp->lanes_q16;
            }
        }
#endif
        if (!sp->lanes_q) sp->d = dotter_make(&sp->p, q8[k], sp->p.width, heads);
        free(sums);
    }
    int64_t lanes_words = 0; /* the widest token-lane part's words, whole 32-channel chunks */
    for (int k = 0; k < nparts; k++) {
        int64_t words = (parts[k].p.width + 31) / 32 * (SUB_BYTE(parts[k].p.kind) ? 8 : 16);
        lanes_words = parts[k].lanes_q && words > lanes_words ? words : lanes_words;
    }
    int64_t tiles = (n + TT - 1) / TT;
#pragma omp parallel num_threads(tiles < threads ? (int)(tiles > 0 ? tiles : 1) : threads)
    {
        int32_t *dbuf[MAX_PARTS];
        float *sT[MAX_PARTS], *zT[MAX_PARTS];
        for (int k = 0; k < nparts; k++) {
            int64_t G = parts[k].p.groups;
            dbuf[k] = alloc((size_t)(G * heads * TT) * 4);
            sT[k] = alloc((size_t)(G * TT) * 4);
            zT[k] = alloc((size_t)(G * TT) * 4);
        }
        int32_t *lanes_b = lanes_words ? alloc((size_t)(lanes_words * TB) * 4) : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            int64_t t0 = i * TT, nt = n - t0 < TT ? n - t0 : TT;
            scores_tile(parts, nparts, base, pages, page_rows, stride, t0, nt, heads, out, ldo, accumulate, dbuf, sT, zT,
                        lanes_b);
        }
        free(lanes_b);
        if (maxes) { /* each head's max over the n scores (exact in any order); -inf for n = 0 */
#pragma omp for schedule(static)
            for (int64_t h = 0; h < heads; h++) {
                const float *o = out + h * ldo;
                float mx = -INFINITY;
                int64_t t = 0;
#if VECTOR
                __m256 v = _mm256_set1_ps(-INFINITY); /* max_ps(x, v) keeps v where x is NaN, as the scalar form */
                for (; t + 8 <= n; t += 8) v = _mm256_max_ps(_mm256_loadu_ps(o + t), v);
                float lanes[8];
                _mm256_storeu_ps(lanes, v);
                for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
                for (; t < n; t++) mx = o[t] > mx ? o[t] : mx;
                maxes[h] = mx;
            }
        }
        for (int k = 0; k < nparts; k++) {
            free(dbuf[k]);
            free(sT[k]);
            free(zT[k]);
        }
    }
    for (int k = 0; k < nparts; k++) {
        dotter_free(&parts[k].d);
        free(parts[k].qlo);
        free(parts[k].lanes_q16);
        free(parts[k].lanes_corr);
    }
}

/* ---------------------------------------------------------------- P.V */

/* P[t] = clamp(rint(p[t] * (s[t] * r)), +-32767) int16 for t < n, 0 for t in [n, npad). */
static void quantize_probs(const float *p, const float *s, float r, int64_t n, int64_t npad, int16_t *out) {
    int64_t t = 0;
#if VECTOR
    const __m256 hi = _mm256_set1_ps(32767.0f), lo = _mm256_set1_ps(-32767.0f), rv = _mm256_set1_ps(r);
    for (; t + 8 <= n; t += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_mul_ps(_mm256_loadu_ps(s + t), rv));
        x = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi);
        __m256i i = _mm256_cvtps_epi32(x);
        __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storeu_si128((__m128i *)(out + t), packed);
    }
#endif
    for (; t < n; t++) {
        float x = nearbyintf(p[t] * (s[t] * r));
        x = x < -32767.0f ? -32767.0f : x > 32767.0f ? 32767.0f : x;
        out[t] = (int16_t)x;
    }
    for (; t < npad; t++) out[t] = 0;
}

/* sum_t p[t] * z[t] in 8 lanes (lane t % 8, in t order), then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static float lane_dot(const float *p, const float *z, int64_t n) {
    float l[8] = {0};
    int64_t t = 0;
#if VECTOR
    __m256 v = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_loadu_ps(z + t)));
    _mm256_storeu_ps(l, v);
#endif
    for (; t < n; t++) l[t % 8] = l[t % 8] + p[t] * z[t];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* 2^x for x <= 0 (0 below -126), the same FP32 operations in every variant: x = n + f, n = rint(x), |f| <= 1/2,
 * 2^f = 1 + f * P(f) (Cephes' exp2f polynomial, Horner, separate multiplies and adds), times 2^n from its bits. */
#define EXP2_C0 1.535336188319500e-4f
#define EXP2_C1 1.339887440266574e-3f
#define EXP2_C2 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C4 2.402264791363012e-1f
#define EXP2_C5 6.931472028550421e-1f
static inline float exp2_scalar(float x) {
    if (!(x >= -126.0f)) return 0.0f;
    float n = nearbyintf(x), f = x - n;
    float q = EXP2_C0;
    q = q * f + EXP2_C1;
    q = q * f + EXP2_C2;
    q = q * f + EXP2_C3;
    q = q * f + EXP2_C4;
    q = q * f + EXP2_C5;
    float y = q * f + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

#if VECTOR
static inline __m256 exp2_vec(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 q = _mm256_set1_ps(EXP2_C0);
    q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(EXP2_C1));
    q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(EXP2_C2));
    q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(EXP2_C3));
    q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(EXP2_C4));
    q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(EXP2_C5));
    __m256 y = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), keep);
}
#endif

/* p[t] = exp2(x[t] - m) for t < n; returns sum_t p[t] in `lane_dot`'s fixed 8-lane order. */
static float exp2_row(const float *x, float m, int64_t n, float *p) {
    float l[8] = {0};
    int64_t t = 0;
#if VECTOR
    __m256 v = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp2_vec(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        _mm256_storeu_ps(p + t, e);
        v = _mm256_add_ps(v, e);
    }
    _mm256_storeu_ps(l, v);
#endif
    for (; t < n; t++) {
        p[t] = exp2_scalar(x[t] - m);
        l[t % 8] = l[t % 8] + p[t];
    }
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* p = exp2(x - m) elementwise (tests: the kernels' exp2 against torch's). */
void mlaq_exp2(const float *x, int64_t n, float m, float *p, float *sum) { *sum = exp2_row(x, m, n, p); }

/* P.V slab sl of a part (SLAB channels, slabs numbered group by group): its group (returned), first channel *c0
 * and width *w (SLAB, or less at the end of a group). */
static inline int64_t slab_span(const part_t *p, int64_t sl, int64_t *c0, int64_t *w) {
    const int64_t per_group = (p->gs + SLAB - 1) / SLAB, g = sl / per_group;
    *c0 = g * p->gs + (sl % per_group) * SLAB;
    *w = (g + 1) * p->gs - *c0 < SLAB ? (g + 1) * p->gs - *c0 : SLAB;
    return g;
}

#if VECTOR
/* The slab's 16 codes c' of one row as int8 (channels c0.., w <= 16 valid; the rest are never stored). */
INLINE __m128i slab_codes(const int kind, const uint8_t *row, int64_t c0, int64_t w) {
    if (SUB_BYTE(kind) && !IS_INT4(kind)) { /* c0 is a multiple of 16: the slab starts on a byte */
        int bits = BITS(kind);
        __m256i v = _mm256_sub_epi16(fields16(load16(row + c0 * bits / 8, (w * bits + 7) / 8), bits, 0),
                                     _mm256_set1_epi16((short)BIAS(kind)));
        return _mm_packs_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    }
    if (IS_INT4(kind)) {
        __m128i b = load16(row + c0 / 2, (w + 1) / 2), m = _mm_set1_epi8(15);
        __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
        return kind == I4_SYM ? _mm_sub_epi8(x, _mm_set1_epi8(8)) : x;
    }
    __m128i x = load16(row + c0, w);
    return kind == I8_ASYM ? _mm_xor_si128(x, _mm_set1_epi8((char)0x80)) : x;
}

/* The pair of one row pair's slab codes (r1 NULL: zeros) into B, int16 pairs, channels 0..7 then 8..15. */
INLINE void pack_pair(const int kind, const uint8_t *r0, const uint8_t *r1, int64_t c0, int64_t w, int16_t *B) {
    __m128i x0 = slab_codes(kind, r0, c0, w);
    __m128i x1 = r1 ? slab_codes(kind, r1, c0, w) : _mm_setzero_si128();
    _mm256_store_si256((__m256i *)B, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x0, x1)));
    _mm256_store_si256((__m256i *)(B + 16), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x0, x1)));
}

/* Bs[(sl - s0) * slab_ld + 32 i ..] = slab sl's 16 channels x (token 2i, token 2i + 1) as int16 pairs, channels
 * 0..7 then 8..15, for the slabs [s0, s1) of nc rows: row pair by row pair, each row read once front to back
 * (packed slab by slab, every slab's pass over the rows waited on their loads again: docs/cpu.md). One function per
 * kind, and whole slabs at the constant width 16 where every slab is whole (the loads' branches fold away: the
 * 3- and 2-bit bands spent a third of their packing on them). */
INLINE void pack_slabs_of(const part_t *p, const int kind, const uint8_t *const *rows, int64_t nc, int64_t s0,
                          int64_t s1, int64_t slab_ld, int16_t *Bs) {
    int64_t c0[s1 - s0], w[s1 - s0], whole = 1; /* the slabs' spans, once per chunk (not per row pair) */
    for (int64_t sl = s0; sl < s1; sl++) {
        slab_span(p, sl, &c0[sl - s0], &w[sl - s0]);
        whole &= w[sl - s0] == SLAB;
    }
    for (int64_t i = 0; 2 * i < nc; i++) {
        const uint8_t *r0 = rows[2 * i], *r1 = 2 * i + 1 < nc ? rows[2 * i + 1] : NULL;
        int16_t *B = Bs + 32 * i;
        if (whole)
            for (int64_t k = 0; k < s1 - s0; k++) pack_pair(kind, r0, r1, c0[k], SLAB, B + k * slab_ld);
        else
            for (int64_t k = 0; k < s1 - s0; k++) pack_pair(kind, r0, r1, c0[k], w[k], B + k * slab_ld);
    }
}
#define PACK_SLABS_FN(KIND)                                                                                       \
    static __attribute__((noinline)) void pack_slabs_##KIND(const part_t *p, const uint8_t *const *rows,          \
                                                             int64_t nc, int64_t s0, int64_t s1, int64_t slab_ld,  \
                                                             int16_t *Bs) {                                        \
        pack_slabs_of(p, KIND, rows, nc, s0, s1, slab_ld, Bs);                                                     \
    }
PACK_SLABS_FN(I8_SYM)
PACK_SLABS_FN(I8_ASYM)
PACK_SLABS_FN(I4_SYM)
PACK_SLABS_FN(I4_ASYM)
PACK_SLABS_FN(I3_SYM)
PACK_SLABS_FN(I2_SYM)
static void pack_slabs(const part_t *p, const uint8_t *const *rows, int64_t nc, int64_t s0, int64_t s1,
                       int64_t slab_ld, int16_t *Bs) {
    switch (p->kind) {
    case I8_SYM: pack_slabs_I8_SYM(p, rows, nc, s0, s1, slab_ld, Bs); break;
    case I8_ASYM: pack_slabs_I8_ASYM(p, rows, nc, s0, s1, slab_ld, Bs); break;
    case I4_SYM: pack_slabs_I4_SYM(p, rows, nc, s0, s1, slab_ld, Bs); break;
    case I4_ASYM: pack_slabs_I4_ASYM(p, rows, nc, s0, s1, slab_ld, Bs); break;
    case I3_SYM: pack_slabs_I3_SYM(p, rows, nc, s0, s1, slab_ld, Bs); break;
    default: pack_slabs_I2_SYM(p, rows, nc, s0, s1, slab_ld, Bs);
    }
}

/* out[mi][0..16) = sum over the pairs of P[mi][2i..2i+1] . B[i] for heads mi < MT (a small function of its own:
 * the accumulators stay in registers). */
#define PV_MICRO(MT)                                                                                              \
    static __attribute__((noinline)) void pv_micro_##MT(const int16_t *B, int64_t npairs, const int32_t *P,      \
                                                         int64_t ldP, int32_t *out) {                             \
        __m256i acc[MT][2];                                                                                       \
        _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) acc[mi][0] = acc[mi][1] = _mm256_setzero_si256(); \
        for (int64_t i = 0; i < npairs; i++) {                                                                    \
            __m256i b0 = _mm256_load_si256((const __m256i *)(B + 32 * i));                                       \
            __m256i b1 = _mm256_load_si256((const __m256i *)(B + 32 * i + 16));                                  \
            _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) {                                            \
                __m256i pb = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(P + i * ldP + mi)));         \
                acc[mi][0] = PV_MAC(acc[mi][0], b0, pb);                                                          \
                acc[mi][1] = PV_MAC(acc[mi][1], b1, pb);                                                          \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) {                                                \
            _mm256_storeu_si256((__m256i *)(out + 16 * mi), acc[mi][0]);                                          \
            _mm256_storeu_si256((__m256i *)(out + 16 * mi + 8), acc[mi][1]);                                      \
        }                                                                                                         \
    }
#if VNNI
#define PV_MAC(acc, b, p) DPWSSD(acc, b, p)
#else
#define PV_MAC(acc, b, p) add32_into(acc, _mm256_madd_epi16(b, p))
#endif
#if MLAQ_ISA == MLAQ_AVX512VNNI
/* zmm: one B pair vector covers the slab's 16 channels, P comes as an embedded broadcast, 32 registers hold 16 heads */
#define PV_MICRO_Z(MT)                                                                                            \
    static __attribute__((noinline)) void pv_micro_##MT(const int16_t *B, int64_t npairs, const int32_t *P,      \
                                                         int64_t ldP, int32_t *out) {                             \
        __m512i acc[MT];                                                                                          \
        _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) acc[mi] = _mm512_setzero_si512();                \
        for (int64_t i = 0; i < npairs; i++) {                                                                    \
            __m512i b = _mm512_load_si512((const void *)(B + 32 * i));                                           \
            _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) acc[mi] = dpwssd_z_bcast(acc[mi], b, P + i * ldP + mi); \
        }                                                                                                         \
        _Pragma("GCC unroll 16") for (int mi = 0; mi < MT; mi++) _mm512_storeu_si512((void *)(out + 16 * mi), acc[mi]); \
    }
PV_MICRO_Z(1)
PV_MICRO_Z(PV_MT)
#else
PV_MICRO(1)
PV_MICRO(PV_MT)
#endif

/* S[mi][0..w) += the INT32 sums of `pv_micro` for heads mi < mt (PV_MT or 1); P[i * ldP + mi] the heads' pairs. */
INLINE void pv_tile(const int16_t *B, int64_t npairs, const int32_t *P, int64_t ldP, const int mt, double *S,
                    int64_t ldS, int64_t w) {
    int32_t sums[PV_MT * SLAB];
    if (mt == PV_MT) pv_micro_PV_MT(B, npairs, P, ldP, sums);
    else pv_micro_1(B, npairs, P, ldP, sums);
    for (int mi = 0; mi < mt; mi++) {
        double *s = S + mi * ldS;
        const int32_t *v = sums + SLAB * mi;
        if (w == SLAB) {
            for (int k = 0; k < SLAB; k += 4)
                _mm256_storeu_pd(s + k, _mm256_add_pd(_mm256_loadu_pd(s + k),
                                                      _mm256_cvtepi32_pd(_mm_loadu_si128((const __m128i *)(v + k)))));
        } else {
            for (int64_t c = 0; c < w; c++) s[c] += (double)v[c];
        }
    }
}
#endif

/* S[h][(sl - s0) * SLAB + c] = sum_t P[g][h][t] * c'[t][c] over the channels of slabs [s0, s1) (each inside one
 * group), S [heads][(s1 - s0) * SLAB]; chunk by chunk: the chunk's codes packed once into B ((s1 - s0) slabs of
 * PV_CHUNK / 2 pairs, `pack_slabs`), then each slab's MACs. */
static void pv_slabs(const part_t *p, const uint8_t *const *rows, int64_t n, const int32_t *P, int64_t npad,
                     int64_t heads, double *S, int64_t s0, int64_t s1, int16_t *B) {
    int64_t ldS = (s1 - s0) * SLAB;
    for (int64_t i = 0; i < heads * ldS; i++) S[i] = 0.0;
#if VECTOR
    const int64_t slab_ld = PV_CHUNK / 2 * 32;
#endif
    for (int64_t t0 = 0; t0 < n; t0 += PV_CHUNK) {
        int64_t nc = n - t0 < PV_CHUNK ? n - t0 : PV_CHUNK;
#if VECTOR
        pack_slabs(p, rows + t0, nc, s0, s1, slab_ld, B);
#endif
        for (int64_t sl = s0; sl < s1; sl++) {
            int64_t c0, w, g = slab_span(p, sl, &c0, &w);
            const int32_t *Pg = P + (g * npad / 2 + t0 / 2) * heads; /* [pair][head] */
            double *Ss = S + (sl - s0) * SLAB;
#if VECTOR
            const int16_t *Bs = B + (sl - s0) * slab_ld;
            for (int64_t h = 0; h < heads; h += PV_MT) {
                int mt = heads - h < PV_MT ? (int)(heads - h) : PV_MT;
                if (mt == PV_MT) pv_tile(Bs, (nc + 1) / 2, Pg + h, heads, PV_MT, Ss + h * ldS, ldS, w);
                else
                    for (int mi = 0; mi < mt; mi++)
                        pv_tile(Bs, (nc + 1) / 2, Pg + h + mi, heads, 1, Ss + (h + mi) * ldS, ldS, w);
            }
#else
            (void)B;
            int32_t sums[heads][SLAB]; /* exact: a chunk's sums stay below 2^31 */
            memset(sums, 0, sizeof(sums));
            for (int64_t t = 0; t < nc; t++) {
                int32_t cv[SLAB] = {0};
                for (int64_t c = 0; c < w; c++) cv[c] = code_at(rows[t0 + t], p->kind, c0 + c);
                for (int64_t h = 0; h < heads; h++) {
                    int16_t pair[2];
                    memcpy(pair, Pg + (t / 2) * heads + h, 4);
                    int32_t pt = pair[t % 2];
                    for (int c = 0; c < SLAB; c++) sums[h][c] += pt * cv[c];
                }
            }
            for (int64_t h = 0; h < heads; h++)
                for (int64_t c = 0; c < w; c++) Ss[h * ldS + c] += (double)sums[h][c];
#endif
        }
    }
}

/* dst[j * heads + h] = tile[h * QCHUNK / 2 + j]: a chunk's int16 pairs from [head][pair] to [pair][head], 8 x 8
 * blocks by `transpose8` (the scalar copy of each pair took a third of pv_part's own time, band codecs: docs/cpu.md). */
static void transpose_pairs(const int32_t *tile, int64_t heads, int64_t pairs, int32_t *dst) {
    const int64_t ld = QCHUNK / 2;
    int64_t h8 = 0, j8 = 0;
#if VECTOR
    h8 = heads / 8 * 8;
    j8 = pairs / 8 * 8;
    for (int64_t h = 0; h < h8; h += 8)
        for (int64_t j = 0; j < j8; j += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(tile + (h + i) * ld + j));
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(dst + (j + i) * heads + h), r[i]);
        }
#endif
    for (int64_t j = 0; j < pairs; j++)
        for (int64_t h = j < j8 ? h8 : 0; h < heads; h++) dst[j * heads + h] = tile[h * ld + j];
}

/* This thread's share [s0, s1) of the slabs (contiguous, static). */
static void my_slabs(int64_t slabs, int64_t *s0, int64_t *s1) {
#ifdef _OPENMP
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    int t = 0, nt = 1;
#endif
    *s0 = slabs * t / nt;
    *s1 = slabs * (t + 1) / nt;
}

/* acc[h][c] = acc[h][c] * alpha[h] (alpha NULL: 1) + the P.V of one integer part over n block rows (rows[t] its
 * first byte) with probabilities probs [heads][ldq] in [0, 1] (module comment); acc [heads][lda] fp32. */
static void pv_part(const part_t *p, const uint8_t *const *rows, int64_t n, const float *probs, int64_t ldq,
                    int64_t heads, float *acc, int64_t lda, const float *alpha, int threads) {
    const int64_t G = p->groups, npad = (n + 1) / 2 * 2, per_group = (p->gs + SLAB - 1) / SLAB, slabs = G * per_group;
    const int64_t qchunks = (npad + QCHUNK - 1) / QCHUNK;
    float *s = scratch(SC_S, (size_t)(G * n) * 4), *zp = scratch(SC_ZP, (size_t)(G * n) * 4), *r = alloc((size_t)G * 4);
    float *z = alloc((size_t)(heads * G) * 4);
    memset(z, 0, (size_t)(heads * G) * 4);
    int32_t *P = scratch(SC_P, (size_t)(G * heads * npad) * 2); /* [g][pair][head]: int16 pairs (P[2i], P[2i + 1]) */
    double *m_over = alloc((size_t)G * 8);
#pragma omp parallel num_threads(n < 64 ? 1 : threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) load_params(p, rows[t], s + t, zp + t, n);
#pragma omp single
        for (int64_t g = 0; g < G; g++) { /* M_g = max_t |s|: r = 32767 / M_g, m_over = M_g / 32767 */
            float m = 0.0f;
            for (int64_t t = 0; t < n; t++) m = fabsf(s[g * n + t]) > m ? fabsf(s[g * n + t]) : m;
            r[g] = m > 0.0f ? 32767.0f / m : 0.0f;
            m_over[g] = (double)m / 32767.0;
        }
        int16_t *tile = scratch(SC_TILE, (size_t)(heads * QCHUNK) * 2); /* [head][token] of a chunk */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < G * qchunks; i++) {
            int64_t g = i / qchunks, t0 = (i % qchunks) * QCHUNK, nt = npad - t0 < QCHUNK ? npad - t0 : QCHUNK;
            int64_t valid = n - t0 < nt ? n - t0 : nt;
            for (int64_t h = 0; h < heads; h++)
                quantize_probs(probs + h * ldq + t0, s + g * n + t0, r[g], valid, nt, tile + h * QCHUNK);
            transpose_pairs((const int32_t *)tile, heads, nt / 2, P + (g * npad + t0) / 2 * heads);
        }
        if (IS_ASYM(p->kind)) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < G * heads; i++)
                z[i % heads * G + i / heads] = lane_dot(probs + i % heads * ldq, zp + i / heads * n, n);
        }
        int64_t s0, s1;
        my_slabs(slabs, &s0, &s1);
        if (s1 > s0) {
            int64_t ldS = (s1 - s0) * SLAB;
            double *S = scratch(SC_S64, (size_t)(heads * ldS) * 8);
            int16_t *B = scratch(SC_SLAB, (size_t)((s1 - s0) * (PV_CHUNK / 2) * 32) * 2);
            pv_slabs(p, rows, n, P, npad, heads, S, s0, s1, B);
            for (int64_t sl = s0; sl < s1; sl++) {
                int64_t c0, w, g = slab_span(p, sl, &c0, &w);
                for (int64_t h = 0; h < heads; h++)
                    for (int64_t c = 0; c < w; c++) {
                        float v = (float)(m_over[g] * S[h * ldS + (sl - s0) * SLAB + c]);
                        float *a = acc + h * lda + c0 + c;
                        *a = (alpha ? *a * alpha[h] : *a) + (v + z[h * G + g]);
                    }
            }
        }
    }
    free(r);
    free(z);
    free(m_over);
}

/* The online-softmax step of one block from its base-2 scores x [heads][ldp] and block maxes bmax [heads] (the
 * scores kernel's), running max and sum m_run, l_run [heads]: m[h] = max(m_run, bmax) (bmax for the first block),
 * alpha[h] = exp2(m_run - m) (not for the first), p [heads][n] = exp2(x - m), sums[h] = sum_t p in the fixed
 * 8-lane order. Every exp2 is `exp2_scalar`'s. */
static void softmax_step(const float *x, int64_t ldp, int64_t n, int64_t heads, const float *m_run, const float *bmax,
                         int first, float *m, float *alpha, float *p, float *sums, int threads) {
    for (int64_t h = 0; h < heads; h++) {
        m[h] = first || bmax[h] > m_run[h] ? bmax[h] : m_run[h];
        if (!first) alpha[h] = exp2_scalar(m_run[h] - m[h]);
    }
#pragma omp parallel for num_threads(n < 64 ? 1 : threads) schedule(static)
    for (int64_t h = 0; h < heads; h++) sums[h] = exp2_row(x + h * ldp, m[h], n, p + h * n);
}

/* l_run = l_run * alpha + sums (first block: sums), m_run = m. */
static void softmax_update(int64_t heads, const float *m, const float *alpha, const float *sums, int first,
                           float *m_run, float *l_run) {
    for (int64_t h = 0; h < heads; h++) {
        l_run[h] = first ? sums[h] : l_run[h] * alpha[h] + sums[h];
        m_run[h] = m[h];
    }
}

/* acc[h][c] (+)= the P.V of one integer c_kv part over n block rows (module comment), acc [heads][lda] fp32.
 * x [heads][ldp] fp32: the probabilities in [0, 1] (m_run NULL: acc += P.V), or the base-2 scores of one block
 * of an online softmax whose running max and sum per head are m_run, l_run [heads] (in/out) and whose block maxes
 * are bmax [heads] (the scores kernel's): `softmax_step`, acc = acc * alpha + P.V, l_run = l_run * alpha + sum_t p,
 * m_run = m; the first block (first != 0): acc += P.V, l_run = sum_t p. */
void mlaq_pv(const uint8_t *base, const int64_t *pages, int64_t page_rows, int64_t stride, int64_t n, int kind,
             int64_t width, int64_t gs, int64_t scale_off, int64_t zero_off, const float *x, int64_t ldp,
             int64_t heads, float *acc, int64_t lda, float *m_run, float *l_run, const float *bmax, int first,
             int threads) {
    part_t p = make_part(kind, width, gs, scale_off, zero_off);
    const uint8_t **rows = alloc((size_t)n * sizeof(*rows));
    rows_from(base, pages, page_rows, stride, 0, n, rows);
    if (!m_run) {
        pv_part(&p, rows, n, x, ldp, heads, acc, lda, NULL, threads);
        free((void *)rows);
        return;
    }
    float *pbuf = alloc((size_t)(heads * n) * 4), *m = alloc((size_t)heads * 4), *sums = alloc((size_t)heads * 4);
    float *alpha = first ? NULL : alloc((size_t)heads * 4);
    softmax_step(x, ldp, n, heads, m_run, bmax, first, m, alpha, pbuf, sums, threads);
    pv_part(&p, rows, n, pbuf, n, heads, acc, lda, alpha, threads);
    softmax_update(heads, m, alpha, sums, first, m_run, l_run);
    free((void *)rows);
    free(pbuf);
    free(m);
    free(sums);
    free(alpha);
}

/* The whole in-place decode of nseq sequences whose parts are all integer: for each sequence s, block by block
 * (block_tokens, a multiple of page_rows), mlaq_scores into a scratch row block (with its maxes), then the block's
 * online-softmax step and the P.V of each of the first nvalues parts (the c_kv part, or its bands) into acc[s]
 * [heads][lda] at channel value_ch[k], m[s * heads..], l[s * heads..]. pages[s] lists sequence s's pages, lens[s] >
 * 0 its tokens; q8[s * nparts + k], qs[s * nparts + k] its query for part k (desc as mlaq_scores'). One call: no
 * per-block work outside the kernels. With at least as many sequences as threads, the threads take whole
 * sequences (no barrier inside one); fewer, they share each block. Either way every value is computed by the same
 * operations in the same order: the same bits. */
static void decode_sequence(const uint8_t *pool, int64_t page_rows, int64_t stride, const int64_t *pages, int64_t len,
                            int64_t block_tokens, int nparts, const int64_t *desc, const int8_t *const *q8,
                            const float *const *qs, int64_t heads, float *acc, int64_t lda, float *m, float *l,
                            int nvalues, const int64_t *value_ch, int threads) {
    float *scores = scratch(SC_SCORES, (size_t)(heads * block_tokens) * 4), *bmax = alloc((size_t)heads * 4);
    float *p = scratch(SC_PROBS, (size_t)(heads * block_tokens) * 4), *mb = alloc((size_t)heads * 4);
    float *alpha = alloc((size_t)heads * 4), *sums = alloc((size_t)heads * 4);
    const uint8_t **rows = scratch(SC_ROWS, (size_t)block_tokens * sizeof(*rows));
    part_t vp[MAX_PARTS];
    for (int k = 0; k < nvalues; k++) {
        const int64_t *e = desc + 6 * k;
        vp[k] = make_part((int)e[0], e[1], e[2], e[3], e[4]);
    }
    for (int64_t start = 0; start < len; start += block_tokens) {
        int64_t n = len - start < block_tokens ? len - start : block_tokens;
        const int64_t *pg = pages + start / page_rows;
        int first = start == 0;
        mlaq_scores(pool, pg, page_rows, stride, n, nparts, desc, q8, qs, heads, scores, block_tokens, 0, bmax,
                    threads);
        softmax_step(scores, block_tokens, n, heads, m, bmax, first, mb, alpha, p, sums, threads);
        for (int k = 0; k < nvalues; k++) {
            rows_from(pool + desc[6 * k + 5], pg, page_rows, stride, 0, n, rows);
            pv_part(&vp[k], rows, n, p, n, heads, acc + value_ch[k], lda, first ? NULL : alpha, threads);
        }
        softmax_update(heads, mb, alpha, sums, first, m, l);
    }
    free(bmax);
    free(mb);
    free(alpha);
    free(sums);
}

void mlaq_decode(const uint8_t *pool, int64_t page_rows, int64_t stride, int64_t nseq, const int64_t *const *pages,
                 const int64_t *lens, int64_t block_tokens, int nparts, const int64_t *desc, const int8_t *const *q8,
                 const float *const *qs, int64_t heads, float *const *acc, int64_t lda, float *m, float *l,
                 int nvalues, const int64_t *value_ch, int threads) {
    int outer = nseq >= threads && threads > 1;
#pragma omp parallel for num_threads(outer ? threads : 1) schedule(dynamic, 1) if (outer)
    for (int64_t s = 0; s < nseq; s++)
        decode_sequence(pool, page_rows, stride, pages[s], lens[s], block_tokens, nparts, desc, q8 + s * nparts,
                        qs + s * nparts, heads, acc[s], lda, m + s * heads, l + s * heads, nvalues, value_ch,
                        outer ? 1 : threads);
}
