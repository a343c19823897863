"""Which nodes share a loop: elementwise maps of one shape fuse when they
share arguments and their inputs are ready (a forward map and its local
derivative so share one CSE'd body); per-example maps over the same
examples share one loop; every other op is a step of its own. The
scheduler (schedule.py) then builds each step's kernel.

A vector moved k entries (a shift read in place, schedule.shifted) does
not break a loop: a map reading shift(m) of a map m of the loop joins it,
and the loop recomputes m at i - k (cheap arithmetic only, and no more
than MAX_REACH entries away), where a stored m would need a loop of its
own before. An RK4 step (each stage reads the last one moved) so runs as
one loop, not one a stage.

A sum down each column of a loop's value (a batch norm's statistics and
the gradients of its scale and shift, a bias's gradient) is added up in
that loop as it computes the value (MapGroup.sums): the value is then
stored only where something else reads it, and never read back for
the sum (the float32 ResNet's batch norms wrote and reread a 2 MB
matrix for each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import sympy as sp

from symbackprop.base.registry import is_view, record
from symbackprop.ir.construct import guard_of, is_broadcast, is_const
from symbackprop.ir.node import SCALAR, Node, Shape, placeholder, topological_order
from symbackprop.schedule.shifted import foldable, signed_k

# How far (in entries, the lowest to the highest) a loop's member may read
# the loop's other members and inputs: each member is recomputed at most
# MAX_REACH + 1 places. An RK4 step's reverse sweep reads 8 apart.
MAX_REACH = 8
# The most operations (SymPy tree nodes, a member's with those of the loop's
# members it is computed from) a loop computes again at another entry;
# beyond, the value is stored by a loop of its own.
MAX_RECOMPUTED = 200


@dataclass
class ExamplesGroup:
    """Per-example maps over the same examples that run in one loop."""

    index: int
    loops: tuple
    members: list[Node] = field(default_factory=list)
    late: bool = False
    guard: tuple[Node, int] | None = None  # (ir.construct.guard_of) its members' own, one for all


@dataclass
class MapGroup:
    """Members of one fused loop, in execution order."""

    index: int
    shape: Shape
    members: list[Node] = field(default_factory=list)
    late: bool = False  # writes over an input: runs after every other kernel
    sums: list[Node] = field(default_factory=list)  # column sums of members, added up in the loop (_summing_group)

    def nodes(self) -> list[Node]:
        """What the loop computes: its members, then its sums."""
        return self.members + self.sums


@dataclass(frozen=True)
class ProductSum:
    """A sum of matrix products of one shape (and maybe other terms) that
    only the sum reads: the products run, in the order the plan places
    them, into one buffer, the first written and each later one added
    to it (a matmul kernel with `add`: BLAS's beta = 1, or loops that do
    not zero it first), so no product has a buffer of its own and no loop
    adds them up. A `pure` sum (of those products only) is that buffer and
    has no loop of its own; another reads the buffer once, for the first
    product, and the other products' terms as 0."""

    total: Node
    products: tuple[Node, ...]
    pure: bool


# A column sum runs in the loop of what it sums when its rows are at least
# this long: the loop then runs over blocks of columns (ops/elementwise.py
# SUMS_BLOCK_VECTORS), which need rows this long to stream and to give two
# threads a block each; a narrower matrix's sum (a bias of 10 outputs over
# a batch of 32768) keeps its own kernel, which adds several rows at once.
SUMS_MIN_COLUMNS = 4096
SPLIT_SCALAR_MEMBERS = 16  # scalar maps the loss needs, beyond which its scalar steps take no derivative (_splits_first)


class Placement:
    """The plan of one function: its steps in order, each a MapGroup, an
    ExamplesGroup or a node with a kernel of its own. In-place results
    (`inplace`) and what is computed from them run last; the `first`
    results and what they need, first."""

    def __init__(self, results: list[tuple[str, Node]], inplace: frozenset[str] = frozenset(),
                 first: frozenset[str] = frozenset(), sum_products: bool = True):
        self.first = first
        self.results = results
        self.order = topological_order([node for _, node in results])
        overwriting = {node for out, node in results if out in inplace}
        self.overwriting = overwriting
        self.late: set[Node] = set()  # in-place results and what is computed from them
        for node in self.order:
            if node in overwriting or any(a in self.late for a in node.args):
                self.late.add(node)
        self.users: dict[Node, list[Node]] = {node: [] for node in self.order}
        for node in self.order:
            for arg in dict.fromkeys(node.args):
                self.users[arg].append(node)
        self.spreads = self._spreads()
        self.plan: list[MapGroup | ExamplesGroup | Node] = []
        self.group_of: dict[Node, MapGroup] = {}
        self.near: dict[Node, dict[int, MapGroup]] = {}  # the loops holding a node, a user of it or a reader (by index)
        self.index_of: dict[Node, int] = {}
        self.result_nodes = {node for _, node in results}
        self.deferred: set[Node] = set()
        # what the `first` results need (see _splits_first), and the latest scalar step after that split
        self.needed_first = set(topological_order([n for out, n in results if out in first])) if first else set()
        self.latest_after: dict[bool, MapGroup] = {}  # by lateness
        self.split_scalar = sum(n.op == "map" and n.shape == SCALAR for n in self.needed_first) > SPLIT_SCALAR_MEMBERS
        # shifts read in the loops of their users, never stored (an in-place
        # result could overwrite what a loop reads moved: none then)
        self.through: set[Node] = set() if self.late else foldable(self.order, self.users, self.result_nodes)
        self.reach: dict[Node, tuple[int, int]] = {}  # a member's lowest and highest entry read, relative to its own
        self.recomputable: dict[Node, bool] = {}  # a member its loop may compute at other entries too
        self.size: dict[Node, int | None] = {}  # a member's operations (None: it calls a function)
        self.closure: dict[Node, set[Node] | None] = {}  # the members a recomputable one is computed from
        self.summed = self._product_sums() if sum_products else {}  # sums of products added up in one buffer
        self.sum_group: dict[Node, MapGroup] = {}  # each column sum run in a loop, that loop

    def _spreads(self) -> set[Node]:
        """Broadcasts that only elementwise loops read: never stored, those
        loops read the narrower argument with a stride of 0 instead (a
        layer norm's gamma or per-row scale is not written out m x d)."""
        results = {node for _, node in self.results}
        return {node for node in self.order
                if is_broadcast(node) and node not in results and node not in self.late
                and all(user.op == "map" and user not in self.late for user in self.users[node])}

    def _product_sums(self) -> dict[Node, ProductSum]:
        """Each sum (a map whose body adds terms) with two or more terms that
        are products of its shape which only it reads: those run one after
        another into one buffer (see ProductSum). Not for an in-place result
        (its buffer is an input, which the first product would overwrite
        while later kernels still read it)."""
        sums: dict[Node, ProductSum] = {}
        for node in self.order:
            if node.op != "map" or node in self.overwriting or not isinstance(node.attrs[0], sp.Add):
                continue
            terms = node.attrs[0].args
            products = tuple(arg for index, arg in enumerate(node.args)
                             if self._summed_product(arg, node) and _bare_term(placeholder(index), terms))
            if len(products) >= 2:
                sums[node] = ProductSum(node, products, pure=len(products) == len(terms))
        return sums

    def _summed_product(self, arg: Node, total: Node) -> bool:
        """Whether `arg` is a product of `total`'s shape read by `total` alone."""
        return (arg.op == "matmul" and arg.shape == total.shape and arg not in self.result_nodes
                and self.users[arg] == [total])

    def place_all(self) -> set[int]:
        """Place every node; returns the ids of the steps the `first`
        results need, which now lead the plan."""
        for node in self.order:
            if node.op == "leaf" or is_view(node.op) or is_const(node) or node in self.spreads or node in self.through:
                continue
            summed = self.summed.get(node)
            if summed is not None and summed.pure:  # its products' buffer: ready once the last has run
                self.index_of[node] = max(self.index_of[p] for p in summed.products)
                continue
            group = self._summing_group(node)
            if group is not None:  # a column sum of a loop's value: added up in that loop
                group.sums.append(node)
                self.sum_group[node] = group
                self.index_of[node] = group.index
                continue
            fused = record(node.op).fused
            if fused == "elementwise":
                self._place_map(node)
            elif fused == "examples":
                self._place_emap(node)
            else:
                self.index_of[node] = len(self.plan)
                self.plan.append(node)
        self.plan.sort(key=self._is_late)  # stable: the overwriting phase last
        head = self._first_steps()
        self.plan = [s for s in self.plan if id(s) in head] + [s for s in self.plan if id(s) not in head]
        return head

    def _first_steps(self) -> set[int]:
        """The plan steps the `first` results need, closed under what any
        member of those steps reads (a fused loop may hold more than needed)."""
        if not self.first:
            return set()
        step_of: dict[Node, MapGroup | ExamplesGroup | Node] = {}
        for planned in self.plan:
            for member in step_nodes(planned):
                step_of[member] = planned
        todo = [node for out, node in self.results if out in self.first]
        chosen: set[int] = set()
        seen: set[Node] = set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            todo.extend(node.args)
            step: MapGroup | ExamplesGroup | Node | None = step_of.get(node)
            if step is not None and id(step) not in chosen:  # its members once a step (it was once a member)
                chosen.add(id(step))
                todo.extend(step_nodes(step))
        return chosen

    def _summing_group(self, node: Node) -> MapGroup | None:
        """The loop that adds up `node`, a sum down each column (a
        reduction whose record says so: ReduceAttrs.column_sums), as it
        computes the matrix summed: that matrix's loop, in the same phase,
        of more than one row and at least SUMS_MIN_COLUMNS columns. None
        for anything else, and for a loop that reads a moved vector (it
        runs in parts)."""
        if not getattr(record(node.op).attrs, "column_sums", False) or node.attrs[0] != 0:
            return None
        summed = node.args[0]
        columns = sp.sympify(summed.shape[1])
        if not (columns.is_Integer and int(columns) >= SUMS_MIN_COLUMNS):
            return None
        group = self.group_of.get(summed)
        if (group is None or group.shape != summed.shape or any(d == 1 for d in summed.shape)
                or group.late != (node in self.late)):
            return None
        if any(arg in self.through for member in group.members for arg in member.args):
            return None
        return group

    def _is_late(self, step: MapGroup | ExamplesGroup | Node) -> bool:
        return step.late if isinstance(step, (MapGroup, ExamplesGroup)) else step in self.late

    def _place_emap(self, node: Node) -> None:
        """Join the latest loop over the same examples that can run it (its
        arguments are ready before that loop), else open a new one."""
        loops, late, guard = node.attrs[2], node in self.late, guard_of(node)
        chosen: ExamplesGroup | None = None
        for step in reversed(self.plan):
            if isinstance(step, ExamplesGroup) and step.loops == loops and step.late == late and step.guard == guard:
                if all(self._ready_before(arg, step.index) for arg in node.args):
                    chosen = step
                break
        if chosen is None:
            chosen = ExamplesGroup(len(self.plan), loops, late=late, guard=guard)
            self.plan.append(chosen)
        chosen.members.append(node)
        self.index_of[node] = chosen.index

    def _ready_before(self, node: Node, index: int) -> bool:
        base = self._base(node)
        return base.op == "leaf" or is_const(base) or self.index_of.get(base, index) < index

    def _base(self, node: Node) -> Node:
        while is_view(node.op) or node in self.spreads:
            node = node.args[0]
        return node

    def source(self, node: Node) -> tuple[Node, int]:
        """What `node` reads and how far moved: a shift read in place, its
        argument and k; anything else, itself and 0."""
        if node in self.through:
            return node.args[0], signed_k(node)
        return node, 0

    def readers(self, node: Node) -> list[Node]:
        """The nodes that compute with `node`'s entries: its users, those of a
        shift of it read in place instead of the shift."""
        return [r for user in self.users[node] for r in (self.users[user] if user in self.through else [user])]

    def _single_use(self, node: Node) -> bool:
        users = self.users[node]
        return (
            node not in self.result_nodes
            and len(users) == 1
            and users[0].op == "map"
            and users[0].shape == node.shape
        )

    def _scalar_broadcast(self, node: Node) -> bool:
        """A map of scalars to a larger shape, read only by maps of that shape
        that run in the same phase (see `late`) as it."""
        late = node in self.late
        return (node not in self.result_nodes and node.shape != SCALAR and all(a.shape == SCALAR for a in node.args)
                and bool(self.users[node])
                and all(u.op == "map" and u.shape == node.shape and (u in self.late) == late for u in self.users[node]))

    def _with_deferred(self, node: Node) -> list[Node]:
        """`node` preceded by the deferred maps it consumes, arguments first."""
        members: list[Node] = []
        for arg in node.args:
            if arg in self.deferred and arg not in members and arg not in self.group_of:
                members += [m for m in self._with_deferred(arg) if m not in members]
        return members + [node]

    def _place_map(self, node: Node) -> None:
        """Join the latest loop of the same shape that shares an argument and
        can run it; else, if its only user is a map of its shape, defer it into
        the user's loop; else open a new loop. A scalar broadcast read only
        by maps of its shape is deferred into the loop of the first of them
        (it shares no argument with any loop: it would open one of its own)."""
        if (self._single_use(node) or self._scalar_broadcast(node)) and _is_cheap(node.attrs[0]):
            self.deferred.add(node)  # recomputing arithmetic in its user beats a buffer
            return
        members = self._with_deferred(node)
        args = [a for m in members for a in m.args if a not in members]
        chosen: MapGroup | None = None
        reach: dict[Node, tuple[int, int]] = {}
        late = node in self.late
        refused = False  # by the large scalar step of the `first` results
        for group in self._candidates(node, args):  # the latest first
            if group.shape != node.shape or group.late != late:
                continue
            if self._splits_first(group, node):
                refused = True
                continue
            if group.sums and any(a in self.through for a in args):
                continue  # a loop with sums runs whole, never in parts
            if all(self._ready_in(a, group) for a in args):
                reach = self._reaches(members, group)
                if all(high - low <= MAX_REACH for low, high in reach.values()):
                    chosen = group
                    break
        if chosen is None and self._single_use(node):
            self.deferred.add(node)
            return
        if chosen is None:
            chosen = MapGroup(len(self.plan), node.shape, late=late)
            self.plan.append(chosen)
            reach = self._reaches(members, chosen)
            if refused:  # the scalar nodes after the split gather here (_candidates)
                self.latest_after[late] = chosen
        for member in members:
            chosen.members.append(member)
            self.group_of[member] = chosen
            self._note_holder(member, chosen)
            self.index_of[member] = chosen.index
            self.reach[member] = reach[member]
            self._note_cost(member, chosen)

    def _note_cost(self, member: Node, group: MapGroup) -> None:
        """Whether the loop may compute `member` at other entries too: arithmetic
        only, as are the loop's members it reads, and no more than MAX_RECOMPUTED
        operations in all (each of those members counted once)."""
        inner = {s for s in (self.source(a)[0] for a in member.args) if self.group_of.get(s) is group}
        self.size[member] = _arithmetic_size(member.attrs[0])
        closure: set[Node] | None = None
        if self.size[member] is not None and all(self.closure[s] is not None for s in inner):
            closure = {member}.union(*(self.closure[s] for s in inner))  # type: ignore[arg-type]
            if sum(self.size[m] or 0 for m in closure) > MAX_RECOMPUTED:
                closure = None
        self.closure[member] = closure
        self.recomputable[member] = closure is not None

    def _ready_in(self, arg: Node, group: MapGroup) -> bool:
        """Whether a member of `group` can read `arg`: computed before the
        loop, or in it (a shift of a member, recomputed where it is read)."""
        source, k = self.source(arg)
        if self.group_of.get(source) is group:
            return k == 0 or self.recomputable[source]
        return self._ready_before(source, group.index)

    def _reaches(self, members: list[Node], group: MapGroup) -> dict[Node, tuple[int, int]]:
        """Each new member's reach in `group` (see MAX_REACH)."""
        reach: dict[Node, tuple[int, int]] = {}
        for member in members:
            low = high = 0
            for arg in member.args:
                source, k = self.source(arg)
                inside = reach.get(source) or (self.reach[source] if self.group_of.get(source) is group else (0, 0))
                low, high = min(low, inside[0] + k), max(high, inside[1] + k)
            reach[member] = (low, high)
        return reach

    def _candidates(self, node: Node, args: list[Node]) -> list[MapGroup]:
        """The loops that may take `node`, latest first: those related to
        its arguments, and for a scalar node the latest scalar step after
        the split (_splits_first), whose nodes need not share an argument."""
        related = self._related_groups(args)
        after = self.latest_after.get(node in self.late) if node.shape == SCALAR else None
        if after is not None and node not in self.needed_first and all(g is not after for g in related):
            related = sorted([after, *related], key=lambda g: -g.index)
        return related

    def _splits_first(self, group: MapGroup, node: Node) -> bool:
        """Whether `node`, which the `first` results (the loss) do not need,
        stays out of `group`, a scalar step they do need: so when they need
        many scalar maps (SPLIT_SCALAR_MEMBERS), a forward-only call does no
        derivative work (a determinant's minors and its gradient in one
        straight-line body: the forward did all of it, and GCC took 1.7 s
        more than for the two apart); a small one keeps its derivative
        (a loss and its derivative share their arithmetic)."""
        return (self.split_scalar and group.shape == SCALAR and node not in self.needed_first
                and group.members[0] in self.needed_first)

    def _related_groups(self, args: list[Node]) -> list[MapGroup]:
        """The loops that hold one of `args` or read one, latest first: only
        these can take a map (looking at every loop made scheduling
        quadratic in the number of loops)."""
        related: dict[int, MapGroup] = {}
        for arg in args:
            related.update(self.near.get(self.source(arg)[0], {}))
        return [related[k] for k in sorted(related, reverse=True)]

    def _note_holder(self, member: Node, group: MapGroup) -> None:
        """`group` is now near each node `member` holds: itself, its
        arguments, and theirs where an argument is a shift read in place
        (so each node's loops are kept as they are placed: walking a
        matrix entry's hundreds of users per map was quadratic)."""
        held = [member, *member.args, *(a for t in member.args if t in self.through for a in t.args)]
        for node in held:
            self.near.setdefault(node, {})[group.index] = group


def step_nodes(step: MapGroup | ExamplesGroup | Node) -> list[Node]:
    """The nodes a planned step computes."""
    if isinstance(step, MapGroup):
        return step.nodes()
    return step.members if isinstance(step, ExamplesGroup) else [step]


def _bare_term(symbol: sp.Symbol, terms: tuple[sp.Expr, ...]) -> bool:
    """Whether `symbol` is one of `terms` (coefficient 1) and in no other."""
    return symbol in terms and not any(symbol in t.free_symbols for t in terms if t != symbol)


def _is_cheap(body: sp.Expr) -> bool:
    """Arithmetic only (no function calls, no non-integer powers)."""
    return _arithmetic_size(body) is not None


@lru_cache(maxsize=4096)  # a gradient's maps share a few bodies (a product, a negation)
def _arithmetic_size(body: sp.Expr) -> int | None:
    """The size of a body of arithmetic only (its tree's nodes), or None
    where it calls a function or takes a non-integer power."""
    size = 0
    for sub in sp.preorder_traversal(body):
        if isinstance(sub, sp.Function) or (isinstance(sub, sp.Pow) and not sub.exp.is_Integer):
            return None
        size += 1
    return size
