"""Every registration of scan into the other stages, in one place: its
lowering (ir), its derivative rules (autodiff), its kernel builders
(schedule) and its kernels' template data (codegen). Importing this module
makes the stages know scan; symbackprop.scan imports it."""

from __future__ import annotations

from ..autodiff import rules
from ..codegen import register_emitter
from ..ir import register_matrix_rule
from ..schedule import register_kernel
from .bind import PartKernel, ScanKernel
from .declare import ScanFinal, ScanOutput
from .diff import part_jvp, part_vjp, scan_jvp, scan_vjp, unsupported_jvp, unsupported_vjp
from .emit import AddProduct, emit_add_product, emit_part, emit_scan
from .kernels import build_backward, build_forward, build_part
from .lower import lower_final, lower_output

# declare -> IR: the user's ScanOutput and ScanFinal become scan_part nodes of a scan node
register_matrix_rule(ScanOutput, lower_output)
register_matrix_rule(ScanFinal, lower_final)

# differentiate: a scan's VJP is a scan_vjp node, its JVP a scan over tangents
rules("scan", scan_vjp, scan_jvp)
rules("scan_part", part_vjp, part_jvp)
rules("scan_vjp", unsupported_vjp, unsupported_jvp)
rules("scan_seed", unsupported_vjp, unsupported_jvp)

# schedule: one kernel per loop, and a comment for each part it writes
register_kernel("scan", build_forward)
register_kernel("scan_vjp", build_backward)
register_kernel("scan_part", build_part)

# emit: templates/kernel_scan.c.j2, kernel_scan_part.c.j2, kernel_scan_add_product.c.j2
register_emitter(ScanKernel, emit_scan)
register_emitter(PartKernel, emit_part)
register_emitter(AddProduct, emit_add_product)
