"""Every registration of scan into the other stages, in one place: the
records of its ops (symbackprop.base.registry) with their lowering (ir),
derivative rules (autodiff), kernel builders (schedule), kernels' template
data (codegen) and templates. Importing this module makes the stages know
scan; symbackprop.scan imports it."""

from __future__ import annotations

from symbackprop.base.registry import extend, plain_grad_fn
from symbackprop.loops.again import backward_jvp
from symbackprop.loops.declare import ScanFinal, ScanOutput
from symbackprop.loops.diff import backward_vjp_rule, part_jvp, part_vjp, scan_jvp, scan_vjp, unsupported_jvp, unsupported_vjp
from symbackprop.loops.emit import emit_add_product, emit_part, emit_scan
from symbackprop.loops.fixpoint import FixedPointCount, FixedPointFinal
from symbackprop.loops.fixpoint_lower import lower_count
from symbackprop.loops.fixpoint_lower import lower_final as lower_fixed_point
from symbackprop.loops.implicit import fixed_point_vjp
from symbackprop.loops.kernels import build_backward, build_forward, build_part
from symbackprop.loops.lower import lower_final, lower_output
from symbackprop.loops.reshape import reshape as _reshape  # noqa: F401  (registers the "reshape" view)

# a scan node runs the loop; its scan_part nodes name what it writes (the
# user's ScanOutput and ScanFinal lower to them); its VJP is a scan_vjp node
# seeded through scan_seed nodes
extend("scan", loop=True, vjp=scan_vjp, jvp=scan_jvp, grad_fn=plain_grad_fn("Scan"), kernel=build_forward,
       emit=emit_scan, template="kernel_scan.c.j2")  # the kernels of scan and scan_vjp
extend("scan_part", lowering=((ScanOutput, lower_output), (ScanFinal, lower_final)), vjp=part_vjp, jvp=part_jvp,
       grad_fn=plain_grad_fn("ScanOutput"), kernel=build_part, emit=emit_part, template="kernel_scan_part.c.j2")
# differentiated again as a generic scan running backwards (again.py)
extend("scan_vjp", loop=True, vjp=backward_vjp_rule, jvp=backward_jvp, kernel=build_backward)
extend("scan_seed", vjp=unsupported_vjp, jvp=unsupported_jvp)
# a product added into an accumulator inside a step (kernel_scan_add_product.c.j2)
extend("scan_add_product", emit=emit_add_product, template="kernel_scan_add_product.c.j2")
# a fixed point: a scan's loop without sequences that may stop early (loops/fixpoint*.py); its
# parts (final states, count) are scan_part nodes; its VJP is implicit or the scan's (loops/implicit.py)
extend("fixed_point", loop=True, lowering=((FixedPointFinal, lower_fixed_point), (FixedPointCount, lower_count)),
       vjp=fixed_point_vjp, jvp=scan_jvp, grad_fn=plain_grad_fn("FixedPoint"), kernel=build_forward,
       emit=emit_scan, template="kernel_scan.c.j2")
