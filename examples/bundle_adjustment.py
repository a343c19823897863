"""Bundle adjustment's reprojection residuals (the ADBench BA objective).

Observation i sees point pts[pt[i]] through camera cams[cam[i]]; a camera
is 11 numbers: a Rodrigues rotation (3), its centre (3), the focal length,
the principal point (2) and two radial distortion coefficients. The
residual is w_i * (projection - feat_i); the loss is its sum of squares.
The residual of one observation is declared once, for scalars; the C maps
it over the observations with the cameras and points gathered by index,
and its gradient adds each observation's share into the camera and point
it used. `jacobian` is the per-observation 2 x 15 Jacobian with respect to
the camera, the point and the weight, as ADBench computes it.
"""

import numpy as np
import sympy as sp

import symbackprop as sbp
from symbackprop import nn

N, C, P = sp.symbols("N C P", integer=True, positive=True)
cams = sp.MatrixSymbol("cams", C, 11)
pts = sp.MatrixSymbol("pts", P, 3)
weights = sp.MatrixSymbol("weights", N, 1)
feats = sp.MatrixSymbol("feats", N, 2)
cam = sbp.Index("cam", N)
pt = sbp.Index("pt", N)

c = sp.Matrix(sp.symbols("c0:11", real=True))
X = sp.Matrix(sp.symbols("X0:3", real=True))
w = sp.Symbol("w", real=True)
u = sp.Matrix(sp.symbols("u0:2", real=True))


def rodrigues_rotate(rot: sp.Matrix, v: sp.Matrix) -> sp.Matrix:
    """v rotated by the angle-axis vector rot; near zero angle, its first-order
    form (as ADBench), so the derivative is defined there."""
    theta_sq = rot.dot(rot)
    theta = sp.sqrt(theta_sq)
    axis = rot / theta
    cos, sin = sp.cos(theta), sp.sin(theta)
    full = v * cos + axis.cross(v) * sin + axis * axis.dot(v) * (1 - cos)
    small = v + rot.cross(v)
    return sp.Matrix([sp.Piecewise((f, theta_sq > sp.Float(1e-20)), (s, True)) for f, s in zip(full, small)])


def project(c: sp.Matrix, X: sp.Matrix) -> sp.Matrix:
    rotated = rodrigues_rotate(c[0:3, 0], X - c[3:6, 0])
    p = -sp.Matrix(rotated[0:2]) / rotated[2]
    r_sq = p.dot(p)
    distortion = 1 + c[9] * r_sq + c[10] * r_sq**2
    return c[6] * distortion * p + c[7:9, 0]


residual = sbp.map_examples(w * (project(c, X) - u),
                            [(c, sbp.gather(cams, cam)), (X, sbp.gather(pts, pt)), (w, weights), (u, feats)])
jacobian = residual.jacobian(c, X, w)  # N x 30: each row a 2 x 15 block, row-major

model = sbp.Model("bundle_adjustment", inputs=[feats, cam, pt], params=[cams, pts, weights],
                  loss=nn.sum_all(sp.HadamardPower(residual, 2)),
                  outputs={"residual": residual, "jacobian": jacobian})


def sample_data(rng: np.random.Generator, cameras: int = 3, points: int = 5, observations: int = 12) -> dict:
    cams = np.zeros((cameras, 11))
    cams[:, 0:3] = 0.3 * rng.standard_normal((cameras, 3))
    cams[:, 3:6] = rng.standard_normal((cameras, 3))
    cams[:, 6] = 1.0 + 0.1 * rng.random(cameras)
    cams[:, 7:9] = 0.1 * rng.standard_normal((cameras, 2))
    cams[:, 9:11] = 0.01 * rng.standard_normal((cameras, 2))
    pts = rng.standard_normal((points, 3))
    pts[:, 2] += 8.0  # in front of the cameras
    return {
        "cams": cams,
        "pts": pts,
        "weights": 1.0 + 0.1 * rng.standard_normal((observations, 1)),
        "feats": rng.standard_normal((observations, 2)),
        "cam": rng.integers(0, cameras, observations),
        "pt": rng.integers(0, points, observations),
    }
