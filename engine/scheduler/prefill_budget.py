"""How many prompt tokens a prefill step may take while other requests are decoding.

A prefill step stalls every running stream for its whole length. With requests decoding, the step's prompt
tokens are capped so that the gap a stream sees stays within a target inter-token latency: `--itl-target-ms`,
or with 0 (the default) ITL_AUTO_FACTOR times the recent decode step (the goal: ITL p99 within 4x its median).
In a mixed step (the decodes ride in the prefill step, --enable-mixed-chunk) that gap is the step itself, its
decode rows included; otherwise it is the prefill step plus the stream's own decode step after it.
Step time is predicted from the steps already run: a least-squares line (fixed cost + cost per token, every
token of the step counted) over the recent extend and mixed steps, older steps weighing less. Until enough
steps are seen, and with no request decoding, the full step budget applies (time to first token first). The
cap never goes below `min_tokens`, so prefill progresses under any decode load.

The cap depends on wall-clock step times, which differ between ranks: where ranks mirror one scheduler (TP, a
DP-attention group of several ranks) every rank takes its first rank's `state()` before each step
(engine/runtime/rank_loop.py), so that all of them admit the same prompt tokens.

History: the automatic cap without mixed steps (prefill and decode steps alternating) cost 0.62x the output
tok/s at concurrency 64 on one H100 (docs/perf.md, "The prefill cap that follows the decode load"): each capped
prefill step also cost a whole decode step after it. Mixed steps, in piecewise CUDA graphs, pay for both.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

ITL_AUTO_FACTOR = 3.0  # the default target: this many decode steps (the p99/p50 goal is 4x)
DECAY = 0.95  # weight of a past observation after each new one
WARMUP_STEPS = 3  # extend steps (of different sizes) seen before the line is trusted


@dataclass
class _Line:
    """Weighted least squares of seconds against tokens, with exponential forgetting."""
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    seen: int = 0

    def add(self, x: float, y: float) -> None:
        self.n, self.sx, self.sy = self.n * DECAY + 1, self.sx * DECAY + x, self.sy * DECAY + y
        self.sxx, self.sxy = self.sxx * DECAY + x * x, self.sxy * DECAY + x * y
        self.seen += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the points do not determine a rising line."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.seen < WARMUP_STEPS or var <= 1e-9 * max(1.0, self.sxx * self.n):
            return None
        slope = (self.n * self.sxy - self.sx * self.sy) / var
        if slope <= 0:
            return None
        return max(0.0, (self.sy - slope * self.sx) / self.n), slope


class PrefillBudget:
    def __init__(self, itl_target_ms: float, min_tokens: int):
        """`itl_target_ms`: > 0 a fixed target, 0 automatic (from the decode steps), < 0 no cap."""
        self.target_s = itl_target_ms / 1000 if itl_target_ms > 0 else None
        self.enabled = itl_target_ms >= 0
        self.min_tokens = max(1, min_tokens)
        self.extend = _Line()
        self.decode_s: float | None = None  # moving average of recent decode steps

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        """A finished step: 'extend' or 'mixed' with all its tokens (prompt and decode rows), or 'decode' /
        'spec' (a decode step)."""
        if kind in ("extend", "mixed") and tokens > 0:
            self.extend.add(float(tokens), seconds)
        elif kind in ("decode", "spec"):
            self.decode_s = seconds if self.decode_s is None else 0.9 * self.decode_s + 0.1 * seconds

    def state(self) -> tuple:
        """What the cap is computed from (the fitted points and the decode-step average), to copy to mirrors."""
        return astuple(self.extend), self.decode_s

    def set_state(self, state: tuple) -> None:
        line, self.decode_s = state
        self.extend = _Line(*line)

    def target_seconds(self, decoding: int = 0) -> float | None:
        """The gap a stream may see: the fixed target, or ITL_AUTO_FACTOR decode steps. Before any decode step
        ran (mixed steps carry the decodes while prompts keep arriving) a decode step of `decoding` requests
        is what the extend line predicts for that many tokens (more than a CUDA-graph decode step takes)."""
        if self.target_s is not None:
            return self.target_s
        decode = self.decode_s
        if decode is None:
            line = self.extend.fit()
            if line is None:
                return None
            decode = line[0] + line[1] * decoding
        return ITL_AUTO_FACTOR * decode

    def tokens(self, step_budget: int, decoding: int, mixed: bool = False) -> int:
        """This step's prompt-token cap (`step_budget` when nothing decodes or nothing is known yet); `mixed`:
        the `decoding` requests ride in this step (one token each, not part of the cap)."""
        if not self.enabled or decoding == 0:
            return step_budget
        target, line = self.target_seconds(decoding), self.extend.fit()
        if target is None or line is None:
            return step_budget
        fixed, per_token = line
        if mixed:  # the stream waits for this one step, which carries its token
            cap = int((target - fixed) / per_token) - decoding
        else:  # the stream waits for this step and for its own next decode step
            cap = int((target - fixed - (self.decode_s or 0.0)) / per_token)
        return min(step_budget, max(self.min_tokens, cap))
