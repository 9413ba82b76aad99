"""CMA-ES with pycma's default settings, as a pure, jittable JAX state machine.

FOA (``mr-eggplant/FOA:tta_library/foa.py``) optimizes its prompts with
``cma.CMAEvolutionStrategy(dim * [0], 1, {'seed': 2020, 'popsize': 27})``.
For its dimension (3 x 768 = 2304) and the pycma of 2024 (3.3/3.4, up to 4.0),
the defaults are: full covariance, active CMA (negative weights), cumulative
step-size adaptation (CSA), a lazy eigendecomposition, and no bounds. This
module reimplements exactly that update (the formulas below are pycma's, with
its constants), because FOA's step differs from a textbook CMA-ES in ways a
generic library does not express:

* FOA tells ``popsize + 1`` solutions: the 27 sampled ones plus the previous
  batch's best. pycma then uses the weights of ``popsize`` with zeros inserted
  after the ``mu`` positive ones (``RecombinationWeights.__call__(lam)``).
* A told solution that was not sampled by ``ask`` (the previous best) is
  first clipped to Mahalanobis length ``sqrt(N) + 2N/(N+2)`` around the mean
  (``repair_genotype``); sampled ones are used as they are.
* ``cs = (mueff+2)/(N+mueff+3)`` and ``cmu`` with pycma's ``+0.25`` term
  (``interfaces.py``), not the tutorial's; ``sigma`` changes by at most e^1.
* B and D (``C = B diag(D^2) B^T``) are recomputed only every
  ``1/(c1+cmu)/N/10`` tells (pycma's ``lazy_update_gap``); between, sampling,
  the path ``ps`` and the Mahalanobis norms use the stale decomposition.

Random numbers are JAX's, so the samples differ from pycma's numpy stream;
given the same samples and fitnesses the update matches pycma (see
tests/test_foa.py).
"""

from __future__ import annotations

import dataclasses
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@flax.struct.dataclass
class CMAState:
  """The search distribution ``N(mean, sigma^2 C)`` and its evolution paths."""

  mean: Array  # [N]
  sigma: Array  # []
  C: Array  # [N, N]
  B: Array  # [N, N] eigenvectors of C at the last decomposition
  D: Array  # [N] square roots of its eigenvalues
  ps: Array  # [N] conjugate evolution path (CSA)
  pc: Array  # [N] evolution path (rank-one update)
  count: Array  # [] int32: tells so far (pycma's countiter)
  decomposed_at: Array  # [] int32: the count at the last eigendecomposition


def _limit_sum(neg: np.ndarray, limit: float) -> np.ndarray:
  s = -neg.sum()
  return neg * (limit / s) if s > limit else neg


@dataclasses.dataclass(frozen=True)
class CMAES:
  """pycma's ``CMAEvolutionStrategy`` defaults for dimension ``dim`` and ``popsize`` (host-side constants)."""

  dim: int
  popsize: int
  sigma0: float = 1.0

  def __post_init__(self):
    n, lam = self.dim, self.popsize
    raw = math.log((lam + 1) / 2) - np.log(np.arange(1, lam + 1))
    mu = lam // 2
    pos = raw[:mu] / raw[:mu].sum()
    mueff = 1.0 / np.sum(pos**2)
    c1 = min(1.0, lam / 6) * 2 / ((n + 1.3)**2 + mueff)
    cmu = min(1 - c1, 2 * (0.25 + mueff - 2 + 1 / mueff) / ((n + 2)**2 + 2 * mueff / 2))
    neg = raw[mu:]
    neg = neg[neg < 0]
    mueff_minus = neg.sum()**2 / np.sum(neg**2)
    # RecombinationWeights.finalize_negative_weights(N, c1, cmu) with pos_def: sum set, then limited twice.
    neg = neg * ((1 + c1 / cmu) / -neg.sum())
    neg = _limit_sum(neg, (1 - c1 - cmu) / cmu / n)
    neg = _limit_sum(neg, 1 + 2 * mueff_minus / (mueff + 2))
    weights = np.concatenate([pos, np.zeros(lam - mu - len(neg)), neg])
    cs = (mueff + 2) / (n + mueff + 3)
    consts = dict(mu=mu, weights=weights, mueff=mueff, c1=c1, cmu=cmu, cs=cs,
                  cc=(4 + mueff / n) / (n + 4 + 2 * mueff / n),
                  damps=1 + 2 * max(0.0, math.sqrt((mueff - 1) / (n + 1)) - 1) + cs,
                  chin=math.sqrt(n) * (1 - 1 / (4 * n) + 1 / (26 * n**2)),  # pycma: 26, the tutorial 21
                  lazy_gap=1 / (c1 + cmu + 1e-23) / n / 10,
                  max_length=math.sqrt(n) + 2 * n / (n + 2))
    for k, v in consts.items():
      object.__setattr__(self, k, v)

  def weights_for(self, n: int) -> np.ndarray:
    """pycma's weights for ``n >= popsize`` told solutions: zeros inserted after the ``mu`` positive ones."""
    return np.concatenate([self.weights[:self.mu], np.zeros(n - self.popsize), self.weights[self.mu:]])

  def init(self, mean: Array) -> CMAState:
    n = self.dim
    # pycma's GaussFullSampler starts from diag(exp(1e-4 k / N)), "to prevent equal eigenvalues".
    var0 = jnp.exp((1e-4 / n) * jnp.arange(n, dtype=jnp.float32))
    return CMAState(mean=jnp.asarray(mean, jnp.float32), sigma=jnp.asarray(self.sigma0, jnp.float32),
                    C=jnp.diag(var0), B=jnp.eye(n), D=jnp.sqrt(var0), ps=jnp.zeros(n), pc=jnp.zeros(n),
                    count=jnp.zeros((), jnp.int32), decomposed_at=jnp.zeros((), jnp.int32))

  def _decompose(self, s: CMAState) -> CMAState:
    C = (s.C + s.C.T) / 2
    eig, B = jnp.linalg.eigh(C)  # ascending, as pycma's sorted D
    return s.replace(C=C, B=B, D=jnp.sqrt(eig), decomposed_at=s.count)

  def ask(self, key: Array, s: CMAState) -> tuple[Array, CMAState]:
    """``popsize`` samples ``mean + sigma B (D * z)``, decomposing C first when the lazy gap has passed."""
    stale = s.count >= s.decomposed_at + self.lazy_gap
    s = jax.lax.cond(stale & (s.count > 0), self._decompose, lambda s: s, s)
    z = jax.random.normal(key, (self.popsize, self.dim))
    return s.mean + s.sigma * (z * s.D) @ s.B.T, s

  def _inv_sqrt(self, s: CMAState, y: Array) -> Array:
    """``C^{-1/2} y`` (rows of ``y``) with the current decomposition."""
    return ((y @ s.B) / s.D) @ s.B.T

  def tell(self, s: CMAState, solutions: Array, fitness: Array, sampled: Array) -> CMAState:
    """One pycma ``tell`` (minimization) with ``solutions [n, N]`` and ``fitness [n]``, n >= popsize.

    ``sampled[i]`` False marks a solution ``ask`` did not produce: it is clipped to Mahalanobis length
    ``sqrt(N) + 2N/(N+2)`` first (pycma's ``repair_genotype``).
    """
    n = solutions.shape[0]
    w = jnp.asarray(self.weights_for(n), jnp.float32)
    dx = solutions - s.mean
    length = jnp.linalg.norm((dx @ s.B) / s.D, axis=-1) / s.sigma
    fac = jnp.where(sampled, 1.0, jnp.maximum(length / self.max_length, 1.0))
    pop = s.mean + dx / fac[:, None]
    pop = pop[jnp.argsort(fitness, stable=True)]
    count = s.count + 1

    mean = w[:self.mu] @ pop[:self.mu]
    y = (mean - s.mean) / s.sigma
    ps = (1 - self.cs) * s.ps + math.sqrt(self.cs * (2 - self.cs) * self.mueff) * self._inv_sqrt(s, y)
    norm_ps2 = jnp.sum(ps**2) / (1 - (1 - self.cs)**(2 * count.astype(jnp.float32)))
    hsig = (norm_ps2 / self.dim - 1 < 1 + 4.0 / (self.dim + 1)).astype(jnp.float32)
    pc = (1 - self.cc) * s.pc + hsig * math.sqrt(self.cc * (2 - self.cc) * self.mueff) * y
    c1a = self.c1 * (1 - (1 - hsig**2) * self.cc * (2 - self.cc))

    # GaussFullSampler.update: vectors [sqrt(c1/c1a) pc] + (x - m_old)/sigma, weights [c1a] + cmu * w; the
    # negative-weight vectors are rescaled to Mahalanobis length sqrt(N).
    z = (pop - s.mean) / s.sigma
    ww = self.cmu * w
    ww = jnp.where(ww < 0, ww * self.dim / (jnp.linalg.norm((z @ s.B) / s.D, axis=-1) + 1e-9)**2, ww)
    C = s.C * (1 - c1a - self.cmu * jnp.sum(w)) + self.c1 * jnp.outer(pc, pc) + (z.T * ww) @ z

    step = (self.cs / self.damps) * (jnp.linalg.norm(ps) / self.chin - 1)
    sigma = s.sigma * jnp.exp(jnp.clip(step, -1.0, 1.0))
    return s.replace(mean=mean, sigma=sigma, C=C, ps=ps, pc=pc, count=count)
