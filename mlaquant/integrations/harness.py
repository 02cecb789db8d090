"""lm-evaluation-harness model `mlaquant`: scores and generates through `DecodeSession` over a plan's cache.

    mlaquant-lm-eval --model mlaquant --model_args pretrained=DIR,plan=DIR,device=cpu --tasks ...

`mlaquant-lm-eval` is lm-eval's own command line with this model registered first: lm-eval 0.4.13
resolves `--model` against its built-in registry only (no plugin entry points), so a plain `lm_eval`
never sees a third-party model. In Python, `import mlaquant.integrations.harness` registers it for
`lm_eval.simple_evaluate(model="mlaquant", model_args=...)`.

model_args: pretrained (checkpoint dir; default the bundled model), plan (anything `DecodeSession`
takes: "fp16", "int8", a plan dir, ...), device ("cpu", "cuda"), dtype ("float32", "bfloat16",
"float16"), backend ("auto", "torch", "triton"), max_length (context; default the config's
max_position_embeddings), max_gen_toks (256), batch_size (sequences per prefill). Any other key is an
error naming it.

Every request is a fresh prefill: the context and the scored continuation attend through the quantized
cache, exactly as `DecodeSession.prefill` computes them (no cache is shared between requests).
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from mlaquant.errors import MLAQuantError
from mlaquant.modeling.loader import load_model
from mlaquant.runtime.session import DecodeSession

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KNOWN_ARGS = (
    "pretrained", "plan", "device", "dtype", "backend", "max_length", "max_gen_toks", "batch_size", "max_batch_size",
)  # fmt: skip


@register_model("mlaquant")
class MLAQuantLM(TemplateLM):
    """An lm-eval `LM` over `DecodeSession(load_model(pretrained), plan)` (see module docstring)."""

    def __init__(
        self,
        pretrained: str | None = None,
        plan: str = "fp16",
        device: str | None = "cpu",
        dtype: str = "float32",
        backend: str = "auto",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **unknown,
    ) -> None:
        super().__init__()
        if unknown:
            key = sorted(unknown)[0]
            raise MLAQuantError(
                f"mlaquant lm-eval model: unknown model_args key '{key}' (known: {', '.join(KNOWN_ARGS)})"
            )
        if dtype not in DTYPES:
            raise MLAQuantError(f"mlaquant lm-eval model: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        self.model = load_model(pretrained, dtype=DTYPES[dtype], device=device or "cpu")
        if self.model.tokenizer is None:
            raise MLAQuantError(f"{self.model.source}: no tokenizer.json, which lm-eval needs to turn text into tokens")
        self.session = DecodeSession(self.model, plan=plan, backend=backend)
        self.max_length = int(max_length or self.model.cfg.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self._device = self.model.device

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MLAQuantLM:
        """model_args first; lm-eval's own --device / --batch_size fill only what model_args leave out
        (lm-eval's default passes both as keywords, a TypeError when model_args name `device`)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MLAQuantLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        eos = self.model.cfg.eos_id
        if eos is None:
            raise MLAQuantError(f"{self.model.source}: config.json has no eos_token_id, which lm-eval needs")
        return eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.model.cfg.bos_token_id
        return self.eot_token_id if bos is None else bos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.model.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.model.tokenizer.decode(tokens)

    def token_logprobs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Token lists (each ≥ 1 token, ≤ max_length) → per sequence log-softmax [len, V] float32 of
        `DecodeSession.prefill` (row t: the distribution of the token after inputs[:t + 1])."""
        out = []
        for start in range(0, len(inputs), self.batch_size):
            batch = inputs[start : start + self.batch_size]
            logits = self.session.prefill(batch)
            out += [torch.log_softmax(logits[b, : len(seq)], dim=-1) for b, seq in enumerate(batch)]
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """[(key, context tokens, continuation tokens)] → [(Σ log p(continuation | context), greedy?)]."""
        inputs, conts = [], []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            conts.append(list(continuation))
        results = []
        for logp, cont in zip(self.token_logprobs(inputs), conts):
            scored = logp[-len(cont) :]  # [n, V]: the positions that predict the continuation
            target = torch.tensor(cont)
            total = scored.gather(-1, target[:, None]).sum().item()
            results.append((total, bool(torch.equal(scored.argmax(-1), target))))
            self.cache_hook.add_partial("loglikelihood", None, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's full log-likelihood, scored in disjoint windows of ≤ max_length tokens (lm-eval's rule)."""
        results = []
        for (string,) in [req.args for req in requests]:
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pairs = [(None, *make_disjoint_window(w)) for w in windows]
            results.append(sum(ll for ll, _ in self._loglikelihood_tokens(pairs)))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until a stop string, EOS or max_gen_toks tokens."""
        results = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0):
                raise MLAQuantError(f"mlaquant lm-eval model: greedy generation only, got gen_kwargs {gen_kwargs}")
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new) :] or [self.prefix_token_id]
            results.append(self._greedy(ids, max_new, until))
        return results

    def _greedy(self, ids: list[int], max_new: int, until: list[str]) -> str:
        logits = self.session.prefill([ids])[0, -1]
        new: list[int] = []
        for _ in range(max_new):
            token = int(logits.argmax())
            if token in self.model.cfg.eos_ids:
                break
            new.append(token)
            text = self.tok_decode(new)
            stops = [text.index(s) for s in until if s in text]
            if stops:
                return text[: min(stops)]
            logits = self.session.decode([token])[0]
        return self.tok_decode(new)


def main() -> int:
    """`mlaquant-lm-eval`: lm-eval's command line (`sys.argv`) with the `mlaquant` model registered."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except MLAQuantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
