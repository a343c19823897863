"""Recurrence over a sequence (scan): a step declared in SymPy, run as a C loop.

    Y = symbackprop.scan(step_state, step_output, state, inp, init, sequence)

`state` (a MatrixSymbol, or a tuple of them, e.g. an LSTM's (h, c)) stands
for the state carried from step to step and `inp` for one row of
`sequence` (T x D, T a symbolic dimension bound at call time). At step t,
with state = state_t and inp = sequence[t],

    state_{t+1} = step_state           Y[t] = step_output

for t = 0 .. T-1 from state_0 = init. The step may also use the model's
inputs and params; `Y` (T x O, one row a step) is an ordinary SymPy matrix
expression for the rest of the loss, and `final_state(Y)` the state after
the last step. Vectors may be rows (1 x n) or columns (n x 1); the step's
shapes never depend on T, and neither does the generated C: the step is
scheduled once (fused, CSE'd) and emitted inside a `for` loop over t.

With `batch=B` a step reads B rows (the t-th step of B sequences, stored
time-major: a (T*B) x D sequence): lowering reads each sequence as T rows
of B*D entries and the outputs back as (T*B) x O through a "reshape" view
(reshape.py, the same memory), so the loop is the unbatched one's.

The pipeline, one module per stage, hooked into the stages through their
public hooks, registered by `register` alone (which the op registry
imports on its first look-up, like the built-in families) (one record per op in
symbackprop.base.registry: scan, scan_part, scan_vjp, scan_seed,
scan_add_product):

- lowering (lower.py; the record's `lowering`): a "scan" node whose args are the initial
  states, the sequences and the outer leaves the step reads (captures);
  its attrs hold the step as its own small graph over placeholder leaves.
  The node's own value is the loop's scratch memory; what it computes is
  read through "scan_part" nodes: the outputs, the final states, and the
  states kept for the backward pass.
- reverse mode (diff.py; the records' `vjp`/`jvp`): a "scan_vjp" node, whose kernel runs the
  loop backwards over the kept states with the step's VJP graph (the
  step's forward values are recomputed from its state, so only states are
  kept), accumulating the adjoints of the captures. With
  `checkpoint_every=k` the forward pass keeps every k-th state only
  (ceil(T/k) rows instead of T) and the backward pass recomputes each
  segment of k states from its checkpoint into a k-row buffer first,
  keeping the step's products of its state and inputs (an LSTM's gate
  products) for each step of the segment too, so that the reverse step
  reads them rather than computing them a third time.
- forward mode: the tangent of a scan is a scan over (state, tangent)
  pairs. Second order (again.py): hvp and hessian go reverse over forward
  where the loss holds a scan (the VJP of the tangent scan); a scan_vjp
  differentiated again (sbp.grad of a scan in the loss) is re-expressed,
  there only, as a scan that runs backwards (ScanStep.reverse), whose rules
  are the scan's. A checkpointed scan's backward pass is not differentiated
  again (a ModelError says so).
- kernels (kernels.py, bind.py; the records' `kernel`) and their C
  (emit.py; the records' `emit` and `template`): the step's
  graph is scheduled with the ordinary scheduler; its kernels are emitted
  with buffer names scoped to the loop, inside templates/kernel_scan.c.j2
  (and scan.j2, kernel_scan_add_product.c.j2).

A loop that stops on a condition (`symbackprop.fixed_point`) is the same
machinery: declared in fixpoint.py, lowered (fixpoint_lower.py) to a
"fixed_point" node whose ScanStep has no sequences and an `until` (the
forward loop runs at most max_iter steps and stops when the state's largest
change is <= tol, or NaN, writing the count of steps run as a "count"
part), emitted by the scan's forward loop (the `until` macro of scan.j2);
its derivative (implicit.py) is the implicit function theorem's, as a
second fixed-point loop for the adjoint, or the scan's backward pass from
the count ("unrolled").

The declarations (declare.py, fixpoint.py) need no other stage. (`symbackprop.scan`, the
attribute, is the function: import the modules with
`from symbackprop.loops import emit`; `sbp.scan` is the function.)
"""
