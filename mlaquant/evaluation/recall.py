"""Exact recall over a long context: does the cache still let the model copy what it saw?

Perplexity averages over every token; long exact retrieval is what a low-bit cache loses first. The check: each
prompt is a held-out window whose last `cue` tokens begin a span that occurred earlier in it; the model decodes
`span` greedy tokens, and the share that reproduce the earlier occurrence's continuation, position by position, is
the recall. FP16's share is the ceiling the model itself sets; a plan's gap to it is what its cache costs.

    window  w[0 … T−1]         source p (seeded, in the first half of w[: T − cue])
    prompt  w[0 … T − cue − 1] ‖ w[p … p + cue − 1]            (T tokens)
    target  w[p + cue … p + cue + span − 1]                   (span tokens)
    share   = mean over prompts and positions of [greedy token = target token]
"""

from __future__ import annotations

import dataclasses

import torch

from mlaquant.errors import MLAQuantError
from mlaquant.modeling.protocol import LatentModel
from mlaquant.runtime.plan import Plan
from mlaquant.runtime.session import generate


@dataclasses.dataclass(frozen=True)
class RecallSet:
    """Prompts [n, T] int64 ending in a cue, the continuations they should reproduce [n, span] int64, and where
    each copied span starts in its window [n] int64."""

    prompts: torch.Tensor
    targets: torch.Tensor
    sources: torch.Tensor


def recall_set(windows: torch.Tensor, cue: int = 16, span: int = 64, seed: int = 0) -> RecallSet:
    """`windows` [n, T] int64 → one recall prompt per window (module docstring), the source of each drawn in the
    first half of the window's kept prefix with a seeded generator."""
    n, length = windows.shape
    kept = length - cue
    if cue < 1 or span < 1 or kept // 2 < cue + span:
        raise MLAQuantError(f"recall: windows of {length} tokens cannot hold a cue of {cue} and a span of {span} "
                            f"in the first half of the prompt (need T ≥ {2 * (cue + span) + cue})")
    gen = torch.Generator().manual_seed(seed)
    sources = torch.randint(0, kept // 2 - cue - span + 1, (n,), generator=gen)
    rows = torch.arange(n)[:, None]
    cues = windows[rows, sources[:, None] + torch.arange(cue)]
    targets = windows[rows, sources[:, None] + cue + torch.arange(span)]
    return RecallSet(torch.cat([windows[:, :kept], cues], dim=1), targets, sources)


def recall_share(model: LatentModel, rs: RecallSet, plan: str | Plan = "fp16", backend: str = "torch",
                 batch: int = 8) -> float:
    """The share of `rs.targets` that `plan`'s greedy decode reproduces, `batch` prompts at a time (0 … 1)."""
    hits, total = 0, 0
    span = rs.targets.shape[1]
    for start in range(0, rs.prompts.shape[0], batch):
        got = torch.tensor(generate(model, rs.prompts[start:start + batch], span, plan=plan, backend=backend))
        want = rs.targets[start:start + batch]
        hits += int((got == want).sum())
        total += want.numel()
    return hits / total


class Recall:
    """One recall set (`recall_set` of `windows` [n, T]) scored for FP16 once and for each plan asked: the check the
    calibration report and the sweep carry. `summary(plan)`: {prompts, seq_len, cue, span, fp16, plan,
    vs_fp16_points} (shares 0 … 1, the gap in percentage points)."""

    def __init__(self, model: LatentModel, windows: torch.Tensor, cue: int, span: int, seed: int) -> None:
        self.model, self.rs, self.cue, self.span = model, recall_set(windows, cue, span, seed), cue, span
        self._fp16: float | None = None

    @property
    def fp16(self) -> float:
        if self._fp16 is None:
            self._fp16 = recall_share(self.model, self.rs, "fp16")
        return self._fp16

    def share(self, plan: Plan) -> float:
        return recall_share(self.model, self.rs, plan)

    def summary(self, plan: Plan) -> dict:
        share = self.share(plan)
        n, length = self.rs.prompts.shape
        return {"prompts": int(n), "seq_len": int(length), "cue": self.cue, "span": self.span,
                "fp16": self.fp16, "plan": share, "vs_fp16_points": 100 * (share - self.fp16)}
