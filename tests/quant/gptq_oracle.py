"""A straightforward float64 NumPy GPTQ (Algorithm 1 of Frantar et al., no blocking) for tests."""
import numpy as np


def params(x, bits, sym):
  """x [R, N] -> scale, zero [N] (min/max quantizer with 0 in range)."""
  maxq = 2 ** bits - 1
  lo = np.minimum(x.min(0), 0.0)
  hi = np.maximum(x.max(0), 0.0)
  if sym:
    a = np.maximum(-lo, hi)
    a = np.where(a == 0, 1.0, a)
    scale = 2 * a / maxq
    return scale, np.full_like(scale, 2 ** (bits - 1))
  dead = (lo == 0) & (hi == 0)
  lo = np.where(dead, -1.0, lo)
  hi = np.where(dead, 1.0, hi)
  scale = (hi - lo) / maxq
  return scale, np.clip(np.round(-lo / scale), 0, maxq)


def gptq(w, h, *, bits=4, group_size=None, sym=False, act_order=False, static_groups=False,
         damp=0.01):
  """Returns codes [K, N] in original row order (per row: its group's scale/zero)."""
  w = np.array(w, np.float64)
  h = np.array(h, np.float64)
  k, n = w.shape
  gs = k if group_size in (None, -1) else group_size
  maxq = 2 ** bits - 1
  dead = np.diag(h) <= 0
  h[dead, :] = 0
  h[:, dead] = 0
  h[dead, dead] = 1
  w[dead, :] = 0
  static = [params(w[g:g + gs], bits, sym) for g in range(0, k, gs)]
  perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
  w, h = w[perm], h[perm][:, perm]
  h = h + damp * np.mean(np.diag(h)) * np.eye(k)
  hinv = np.linalg.inv(h)
  codes = np.zeros((k, n), np.int64)
  for i in range(k):
    # Inverse Hessian of the remaining features F = {i, ..., K-1} (Eq. 3 / Sec. 3 of the paper);
    # equals U[i, i:] * U[i, i] with U the upper Cholesky factor of H^-1.
    if static_groups:
      scale, zero = static[perm[i] // gs]
    elif i % gs == 0:
      scale, zero = params(w[i:i + gs], bits, sym)
    q = np.clip(np.round(w[i] / scale) + zero, 0, maxq)
    codes[i] = q
    err = (w[i] - (q - zero) * scale) / hinv[i, i]
    w[i:] -= np.outer(hinv[i:, i], err)
    # Remove feature i from the inverse (Eq. 4): H_F^-1 <- H^-1 - H^-1_{:,i} H^-1_{i,:} / H^-1_ii
    hinv = hinv - np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
  out = np.zeros_like(codes)
  out[perm] = codes
  return out
