"""What a step costs, learned as steps run: the figure that SLO-aware scheduling plans with.

`StepCost` models a step's time as

    seconds = base + per_token * (tokens - decodes) + per_decode * decodes
              + per_kv * decode_kv

where `tokens` is what the step computes (prefill chunks and decodes together),
`decodes` how many of them are decode tokens (drafts included) and `decode_kv`
the context its decodes read (the sum of their positions). A decode's attention
reads its whole KV cache, so at long contexts it costs far more than a prefill
token; and a decode token rides on the weights' read that the step makes anyway,
while a prefill token costs its full share of the weights' compute (on 2 float32
cores: 12 decodes 39 ms a step, 128 prefill tokens beside them 213 ms more), which
one coefficient per token cannot show. The four coefficients are fit by exponentially weighted least squares over the
steps settled so far (so they follow the machine and the batch), with a weak
prior that holds a coefficient where the steps do not tell it apart (a run of
decode-only steps, say).

Its users (all in the scheduler process, all between steps):
- `EDF` (`policy.py`): a chat's slack (how long it can still wait and meet its
  TTFT deadline) and the token cap that keeps a step under the TPOT SLO;
- `EngineCore` (`engine_core.py`): when the step in flight should end, so
  that the next plan is made just before, with the requests arrived meanwhile;
- the planner (`planner.py`): the share of a decoding step pooled prompts may take.
"""

from __future__ import annotations

import math

# Features are scaled to order 1 so that the prior weighs them alike.
_TOKENS = 1e-2  # per hundred tokens (prefill chunks beside decodes are tens)
_KV = 1e-5  # per hundred thousand context positions
_DECODES = 1e-2  # per hundred decode tokens
_N = 4  # features: 1, prefill tokens, decode tokens, decode context


class StepCost:
    """seconds = base + per_token * prefill tokens + per_decode * decodes + per_kv * decode_kv,
    from observed steps."""

    def __init__(
        self,
        base: float = 0.02,
        per_token: float = 2e-4,
        per_kv: float = 1e-6,
        decay: float = 0.97,
        prior_weight: float = 0.01,
        warmup: int = 4,
        per_decode: float | None = None,
    ) -> None:
        per_decode = per_token if per_decode is None else per_decode
        self.base, self.per_token, self.per_kv = base, per_token, per_kv
        self.per_decode = per_decode
        self.decay = decay
        self.warmup = warmup  # observations before `ready`
        self.count = 0
        self._prior = (base, per_token / _TOKENS, per_decode / _DECODES, per_kv / _KV)
        self._lam = prior_weight
        # Decayed normal equations: A = sum x x^T, b = sum x y, over the features x.
        self._a = [[0.0] * _N for _ in range(_N)]
        self._b = [0.0] * _N

    @property
    def ready(self) -> bool:
        """Enough steps seen for predictions to be worth acting on."""
        return self.count >= self.warmup

    def observe(self, tokens: int, seconds: float, decode_kv: int = 0, decodes: int = 0) -> None:
        if tokens <= 0 or not (0.0 < seconds < 60.0):
            return  # an empty step, or a stall (a debugger, a suspended process): no signal
        d = self.decay
        decodes = min(max(decodes, 0), tokens)
        x = (1.0, (tokens - decodes) * _TOKENS, decodes * _DECODES, decode_kv * _KV)
        a, b = self._a, self._b
        for i in range(_N):
            b[i] = b[i] * d + x[i] * seconds
            row = a[i]
            for j in range(_N):
                row[j] = row[j] * d + x[i] * x[j]
        self.count += 1
        self._solve()

    def _solve(self) -> None:
        """Ridge solution (toward the prior) of the normal equations; coefficients that
        come out negative are pinned at 0 and the rest refit."""
        free = list(range(_N))
        while True:
            m = [[self._a[i][j] + (self._lam if i == j else 0.0) for j in free] for i in free]
            v = [self._b[i] + self._lam * self._prior[i] for i in free]
            sol = _gauss(m, v)
            if sol is None:
                return
            bad = [free[k] for k, c in enumerate(sol) if c < 0.0]
            if not bad:
                break
            free = [i for i in free if i not in bad]
            if not free:
                return
        coef = [0.0] * _N
        for k, i in enumerate(free):
            coef[i] = sol[k]
        self.base, self.per_token = coef[0], coef[1] * _TOKENS
        self.per_decode, self.per_kv = coef[2] * _DECODES, coef[3] * _KV

    def predict(self, tokens: int, decode_kv: int = 0, decodes: int = 0) -> float:
        """Seconds a step of `tokens` tokens, `decodes` of them decode tokens, whose decodes
        read `decode_kv` should take."""
        decodes = min(max(decodes, 0), max(tokens, 0))
        return (
            self.base
            + self.per_token * max(0, tokens - decodes)
            + self.per_decode * decodes
            + self.per_kv * max(0, decode_kv)
        )

    def tokens_within(self, seconds: float, decode_kv: int = 0, decodes: int = 0) -> int:
        """The most tokens a step with `decodes` decode tokens whose decodes read
        `decode_kv` can compute in `seconds`: its decodes and the prefill tokens that fit
        beside them (0 if not even its decodes fit)."""
        room = seconds - self.base - self.per_decode * decodes - self.per_kv * max(0, decode_kv)
        if room <= 0.0:
            return 0
        return decodes + (int(math.floor(room / self.per_token)) if self.per_token > 0 else 1 << 30)


def _gauss(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve m x = v by Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    m = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
