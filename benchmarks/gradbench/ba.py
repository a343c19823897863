"""GradBench `ba`: bundle adjustment's residuals and their sparse Jacobian (ADBench's BA).

Definition (cpp/gradbench/evals/ba.hpp): observation i sees point X[i % m] through camera
cams[i % n] (11 numbers: Rodrigues rotation r, centre C, focal length f, principal point
x0, radial distortion k1 k2):
    Xcam = rotate(r, X - C)  (when |r|^2 != 0; else X - C + r x (X - C)),
    p = Xcam[0:2] / Xcam[2],  p = p (1 + k1 |p|^2 + k2 |p|^4),  proj = f p + x0,
    reproj_err_i = w_i (proj - feat_i),   w_err_i = 1 - w_i^2.
`objective` returns reproj_err (p x 2) and w_err (p); `jacobian` the (3p) x (11n + 3m + p)
sparse Jacobian in CSR form: two rows per observation with 15 entries each (its camera's
11, its point's 3, its weight), then one row per weight (-2 w_i). Only `vals` is timed
and compared: `rows` and `cols` depend on the indices only and are built once, by
`symbackprop.sparse_layout` for the residuals' rows.
Data (evals/ba/run.py, ba.hpp's from_json): one camera, point, weight and feature,
replicated n, m, p times, obs = (i % n, i % m). The sizes are ADBench's files
(ba1_n49_m7776_p31843 ...); GradBench runs ba1 and ba2 by default. The files' single
camera/point/weight/feature values are not available here: the port draws them
from np.random.RandomState(31337) (a small rotation, the point 10 units in front).

symbackprop: the residual of one observation declared for scalars, mapped over the
observations with the camera and point gathered by index; its per-observation 2 x 15
Jacobian `residual.jacobian(c, X, w)` in a second model (so the primal does not
compute it). JAX / PyTorch: vmap of jacfwd of the same residual. The Jacobian
reference is JAX's; symbackprop's is also checked against central differences.
"""

from __future__ import annotations

import numpy as np

from ._common import first_calls, jax_module, jax_pair, torch_module, torch_tensors

NAME = "ba"
PRIMAL, DERIVATIVE = "objective", "jacobian"
_FILES = [(1, 49, 7776, 31843), (2, 21, 11315, 36455), (3, 161, 48126, 182072), (4, 372, 47423, 204472),
          (5, 257, 65132, 225911), (6, 539, 65220, 277273), (7, 93, 61203, 287451),
          (8, 88, 64298, 383937), (9, 810, 88814, 393775), (10, 1197, 126327, 563734)]
SIZES = [{"file": f, "n": n, "m": m, "p": p} for f, n, m, p in _FILES]
DEFAULT = SIZES[1]  # GradBench's default runs ba1 and ba2
SMALL = SIZES[0]
SCALING = [SIZES[0], SIZES[2], SIZES[5], SIZES[9]]


def label(size: dict) -> str:
    return f"ba{size['file']} n={size['n']},m={size['m']},p={size['p']}"


def work(size: dict) -> float:
    return float(size["p"])


def generate(size: dict) -> dict:
    n, m, p = size["n"], size["m"], size["p"]
    rs = np.random.RandomState(31337)
    cam = np.concatenate([0.1 * rs.standard_normal(3), rs.standard_normal(3), [400.0 + 10 * rs.rand()],
                          rs.standard_normal(2), 1e-3 * rs.standard_normal(2)])
    X = rs.standard_normal(3) + np.array([0.0, 0.0, 10.0])
    w = 1.0 + 0.1 * rs.standard_normal()
    feat = rs.standard_normal(2)
    i = np.arange(p)
    return {"cams": np.tile(cam, (n, 1)), "X": np.tile(X, (m, 1)), "w": np.full(p, w),
            "feats": np.tile(feat, (p, 1)), "cam": (i % n).astype(np.int64), "pt": (i % m).astype(np.int64)}


def csr_indices(data: dict) -> tuple[np.ndarray, np.ndarray]:
    """GradBench's `rows` (row pointers) and `cols` for the Jacobian: the
    residuals' rows as symbackprop's sparse layout of `residual.jacobian(c, X, w)`
    gives them (columns: cams, then X, then w, each flattened), then one row per weight."""
    import symbackprop as sbp

    layout = sbp.sparse_layout(*_declare())
    indptr, indices, (_, width) = layout.csr(_arrays(data))
    p = len(data["w"])
    cols = np.concatenate([indices, width - p + np.arange(p)])
    return np.concatenate([indptr, indptr[-1] + np.arange(1, p + 1)]), cols


def residual_rows(c, X, w, feat, xp=np):
    """The residual of each row (c: k x 11, X: k x 3, w: k, feat: k x 2), vectorised."""
    rot, Xo = c[:, 0:3], X - c[:, 3:6]
    sq = (rot * rot).sum(1)
    theta = xp.sqrt(xp.where(sq != 0, sq, 1.0))
    axis = rot / theta[:, None]
    cos, sin = xp.cos(theta)[:, None], xp.sin(theta)[:, None]
    full = Xo * cos + xp.cross(axis, Xo) * sin + axis * ((axis * Xo).sum(1)[:, None] * (1 - cos))
    small = Xo + xp.cross(rot, Xo)
    Xcam = xp.where((sq != 0)[:, None], full, small)
    pr = Xcam[:, 0:2] / Xcam[:, 2:3]
    r2 = (pr * pr).sum(1)[:, None]
    pr = pr * (1 + c[:, 9:10] * r2 + c[:, 10:11] * r2 * r2)
    proj = pr * c[:, 6:7] + c[:, 7:9]
    return w[:, None] * (proj - feat)


def reference(data: dict) -> tuple[dict, dict | None]:
    r = residual_rows(data["cams"][data["cam"]], data["X"][data["pt"]], data["w"], data["feats"])
    return {"reproj_err": r, "w_err": 1 - data["w"] ** 2}, None


def fd_error(data: dict, deriv: dict, eps: float = 1e-6) -> float:
    """Central differences of the residual, column by column of the 2 x 15 blocks."""
    c, X, w, f = data["cams"][data["cam"]], data["X"][data["pt"]], data["w"], data["feats"]
    inputs = np.concatenate([c, X, w[:, None]], axis=1)
    cols = []
    for j in range(15):
        up, down = inputs.copy(), inputs.copy()
        up[:, j] += eps
        down[:, j] -= eps
        r = lambda z: residual_rows(z[:, :11], z[:, 11:14], z[:, 14], f)  # noqa: E731
        cols.append((r(up) - r(down)) / (2 * eps))  # p x 2
    blocks = np.stack(cols, axis=2)  # p x 2 x 15
    p = len(w)
    want = np.concatenate([blocks.reshape(p, 30).ravel(), -2 * w])
    got = np.asarray(deriv["vals"])
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _declare():
    """The residual of one observation mapped over the observations, and its keys (c, X, w)."""
    import sympy as sp

    import symbackprop as sbp

    N, C, P = sp.symbols("N C P", integer=True, positive=True)
    cams = sp.MatrixSymbol("cams", C, 11)
    pts = sp.MatrixSymbol("X", P, 3)
    weights = sp.MatrixSymbol("w", N, 1)
    feats = sp.MatrixSymbol("feats", N, 2)
    cam, pt = sbp.Index("cam", N), sbp.Index("pt", N)
    c = sp.Matrix(sp.symbols("c0:11", real=True))
    X = sp.Matrix(sp.symbols("X0:3", real=True))
    w = sp.Symbol("w_", real=True)
    u = sp.Matrix(sp.symbols("u0:2", real=True))
    rot, Xo = c[0:3, 0], X - c[3:6, 0]
    sq = rot.dot(rot)
    theta = sp.sqrt(sq)
    axis = rot / theta
    full = Xo * sp.cos(theta) + axis.cross(Xo) * sp.sin(theta) + axis * axis.dot(Xo) * (1 - sp.cos(theta))
    small = Xo + rot.cross(Xo)
    Xcam = [sp.Piecewise((a, sp.Ne(sq, 0)), (b, True)) for a, b in zip(full, small)]
    p = sp.Matrix([Xcam[0] / Xcam[2], Xcam[1] / Xcam[2]])
    r2 = p.dot(p)
    p = p * (1 + c[9] * r2 + c[10] * r2**2)
    proj = p * c[6] + c[7:9, 0]
    bindings = [(c, sbp.gather(cams, cam)), (X, sbp.gather(pts, pt)), (w, weights), (u, feats)]
    return sbp.map_examples(w * (proj - u), bindings), c, X, w  # N x 2


def build_models(size: dict) -> dict:

    import symbackprop as sbp

    residual, c, X, w = _declare()
    (_, cams), (_, pts), (_, weights), (_, feats) = residual.bindings
    cam, pt = cams.index, pts.index
    cams, pts = cams.array, pts.array
    w_err = sbp.map_examples(1 - w**2, [(w, weights)])  # N x 1
    # outputs only, no loss: the eval asks for none (a loss would be a sum over the residuals more)
    common = {"inputs": [feats, cam, pt], "params": [cams, pts, weights]}
    return {
        "primal": sbp.Model("gradbench_ba", outputs={"reproj_err": residual, "w_err": w_err}, **common),
        "derivative": sbp.Model("gradbench_ba_jac", outputs={"J": residual.jacobian(c, X, w)}, **common),
    }


SBP_FUNCTIONS = ("forward",)


def _arrays(data: dict) -> dict:
    return {"cams": data["cams"], "X": data["X"], "w": data["w"].reshape(-1, 1), "feats": data["feats"],
            "cam": data["cam"], "pt": data["pt"]}


def sbp_calls(mods: dict, data: dict):
    arrays = _arrays(data)
    w = data["w"]

    def primal():
        out = mods["primal"].forward(**arrays)
        return {"reproj_err": out["reproj_err"], "w_err": out["w_err"]}

    def derivative():
        J = mods["derivative"].forward(**arrays)["J"]  # p x 30
        return {"vals": np.concatenate([J.ravel(), -2.0 * w])}

    return primal, derivative


def _one(xp):
    def residual(c, X, w, f):
        return residual_rows(c[None], X[None], w[None], f[None], xp)[0]
    return residual


def jax_calls(data: dict):
    jax = jax_module()
    import jax.numpy as jnp

    one = _one(jnp)
    jac = jax.vmap(jax.jacfwd(one, argnums=(0, 1, 2)))

    def primal(cams, X, w, feats, cam, pt):
        return {"reproj_err": residual_rows(cams[cam], X[pt], w, feats, jnp), "w_err": 1 - w * w}

    def derivative(cams, X, w, feats, cam, pt):
        Jc, JX, Jw = jac(cams[cam], X[pt], w, feats)
        blocks = jnp.concatenate([Jc, JX, Jw[:, :, None]], axis=2)  # p x 2 x 15
        return {"vals": jnp.concatenate([blocks.reshape(-1), -2.0 * w])}

    args = tuple(data[k] for k in ("cams", "X", "w", "feats", "cam", "pt"))
    return jax_pair(primal, derivative, args)


def torch_calls(data: dict, compiled: bool):
    torch = torch_module()

    t = torch_tensors({k: data[k] for k in ("cams", "X", "w", "feats", "cam", "pt")})
    one = _one(_TorchNp(torch))
    jac = torch.func.vmap(torch.func.jacfwd(one, argnums=(0, 1, 2)))

    def primal_fn(cams, X, w, feats, cam, pt):
        return residual_rows(cams[cam], X[pt], w, feats, _TorchNp(torch)), 1 - w * w

    def deriv_fn(cams, X, w, feats, cam, pt):
        Jc, JX, Jw = jac(cams[cam], X[pt], w, feats)
        blocks = torch.cat([Jc, JX, Jw[:, :, None]], dim=2)
        return torch.cat([blocks.reshape(-1), -2.0 * w])

    if compiled:
        primal_fn, deriv_fn = torch.compile(primal_fn), torch.compile(deriv_fn)
    args = tuple(t[k] for k in ("cams", "X", "w", "feats", "cam", "pt"))

    def primal():
        r, we = primal_fn(*args)
        return {"reproj_err": r, "w_err": we}

    return first_calls(primal, lambda: {"vals": deriv_fn(*args)}, compiled)


class _TorchNp:
    """The numpy names residual_rows uses, for torch tensors."""

    def __init__(self, torch):
        self.t = torch

    def sqrt(self, x):
        return self.t.sqrt(x)

    def cos(self, x):
        return self.t.cos(x)

    def sin(self, x):
        return self.t.sin(x)

    def where(self, cond, a, b):
        return self.t.where(cond, a, self.t.as_tensor(b, dtype=self.t.float64) if not self.t.is_tensor(b) else b)

    def cross(self, a, b):
        return self.t.linalg.cross(a, b, dim=-1)
