"""What a step costs, learned as steps run: the figure that SLO-aware scheduling plans with.

`StepCost` models a step's time as `base + per_token * tokens` (tokens: what
the step computes, prefill chunks and decodes together), fit by exponentially
weighted least squares over the steps settled so far, so that it follows the
machine and the batch as they change. Until it has seen steps of different
sizes it keeps its prior slope and fits only the base.

Its users (all in the scheduler process, all between steps):
- `EDF` (`policy.py`): a chat's slack (how long it can still wait and meet its
  TTFT deadline) and the token cap that keeps a step under the TPOT SLO;
- `EngineCore` (`engine_core.py`): when the step in flight should end, so
  that the next plan is made just before, with the requests arrived meanwhile.
"""

from __future__ import annotations

import math


class StepCost:
    """seconds = base + per_token * tokens, from observed (tokens, seconds) pairs."""

    def __init__(
        self, base: float = 0.02, per_token: float = 2e-4, decay: float = 0.97, warmup: int = 4
    ) -> None:
        self.base = base
        self.per_token = per_token
        self.decay = decay
        self.warmup = warmup  # observations before `ready`
        self.count = 0
        # Decayed sums of weights, x, y, x*x, x*y.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        """Enough steps seen for predictions to be worth acting on."""
        return self.count >= self.warmup

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not (0.0 < seconds < 60.0):
            return  # an empty step, or a stall (a debugger, a suspended process): no signal
        d = self.decay
        x = float(tokens)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + seconds
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * seconds
        self.count += 1
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > max(1.0, 0.01 * mx * mx):  # sizes vary enough to fit a slope
            slope = (self._xy / self._w - mx * my) / var
            if slope > 0.0:
                self.per_token = slope
        self.base = max(0.0, my - self.per_token * mx)

    def predict(self, tokens: int) -> float:
        """Seconds a step of `tokens` tokens should take."""
        return self.base + self.per_token * max(0, tokens)

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a step can compute in `seconds` (0 if even an empty one cannot)."""
        room = seconds - self.base
        if room <= 0.0:
            return 0
        return int(math.floor(room / self.per_token)) if self.per_token > 0 else 1 << 30
