"""Score and mask modifiers of an attention spec as `@triton.jit` hooks of the static kernels (kernel.py).

A score that reads positions, tensors or call-time values besides the contraction (ALiBi `slope * (key - query)`,
a bias `bias[head query key]`, a learned temperature `tau[head]`) is the certificate's modifier s' = M(x) of the
scaled score x; a mask other than the plain causal one is any boolean expression of positions, scalar inputs and
tensors. Both become device functions of the generated module, evaluated tile by tile on broadcastable index tiles
i (queries) and j (keys), so the same hook serves the forward's [queries, keys] tiles and the backward's transposed
[keys, queries] tiles:

    SCORE(s, i, j, b, h, C) -> s'            DSCORE(s, i, j, b, h, C) -> ds'/ds
    SCORE_GRADS(ds', s, i, j, b, h, C, G)    adds ds' dM/dT into the fp32 gradient buffer of each float tensor T
    MASK(i, j, b, h, C) -> visible           KEY_RANGE(rows, b, h, C), QUERY_RANGE(cols, b, h, C)

C is the call's context tuple: (N_Q, N_K, GROUP, Q_OFFSET, K_OFFSET, N_Q_TOTAL, N_K_TOTAL, then per tensor its pointer
and one stride per dimension, then the scalar inputs and axis sizes the hooks read); G holds the gradient buffers
(pointer and strides each). i and j index the call's rows and keys, and so do the tensors' query and key dimensions;
a position read as a value is i + Q_OFFSET or j + K_OFFSET and size(query), size(key) are the totals. One device's
call passes offsets 0 and its own sizes; context parallelism (ring.py) passes where a shard's rows and keys sit in
the whole sequence, so the hooks see the same positions as the whole-sequence op. The ranges
come from the mask's exact visible interval (mask_ranges.py): (lo, full_lo, full_hi, hi) such that the block of rows
sees no key outside [lo, hi) and every key in [full_lo, full_hi), so the kernels skip blocks outside and run the
inside without the mask. Without an interval the range is everything, every block masked."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import sympy

from ncd import ir
from ncd.codegen.pytext import drop_double_parens, fit
from ncd.errors import NotStreamable
from ncd.families.attention.mask_ranges import Interval, describe, visible_interval
from ncd.streaming import FLOAT_DTYPES, Certificate, X, modifier_leaves, modifier_symbol
from ncd.symbolic import TritonPrinter

# what a hook's index variables stand for: the tensor dimension roles
BATCH, HEAD, KV_HEAD, GROUP_INDEX, QUERY, KEY = "b", "h", "hk", "g", "i", "j"
INDEX = "x"  # a dimension read at an index expression (a gather: T5's table[head, clamp(key - query, -R, R) + R])
_ROLE_TEXT = {BATCH: "b", HEAD: "h", KV_HEAD: "(h // C[2])", GROUP_INDEX: "(h % C[2])", QUERY: "i", KEY: "j"}
# a position as a value (not as a tensor's index): the call's index plus its shard's offset
_VALUE_TEXT = {**_ROLE_TEXT, QUERY: "(i + C[3])", KEY: "(j + C[4])"}
SLOTS = 7  # N_Q, N_K, GROUP, Q_OFFSET, K_OFFSET, N_Q_TOTAL, N_K_TOTAL


class UnsupportedModifier(NotStreamable):
    code = "unsupported"


@dataclass(frozen=True)
class ModTensor:
    name: str
    roles: tuple[str, ...]  # per declared dimension (INDEX: read at an integer expression of positions)
    float: bool  # takes a gradient (a float tensor read by the score)
    in_score: bool
    index: tuple[str, ...] = ()  # per dimension: the Triton text of its index expression ("" for a role's position)
    positions: frozenset[str] = frozenset()  # the roles the index expressions read (their bounds mask the load)
    in_mask: bool = False  # read by the mask (so by its range hooks: what blocks a row sees depends on it)

    @property
    def reads(self) -> frozenset[str]:
        """The positions its value varies with: its dimensions' roles and its index expressions' positions."""
        return frozenset(self.roles) | self.positions


@dataclass(frozen=True)
class Modifiers:
    """The hooks' source and what the host passes them."""

    has_score: bool
    has_mask: bool
    tensors: tuple[ModTensor, ...]
    scalars: tuple[str, ...]  # scalar inputs the hooks read, in context order
    sizes: tuple[str, ...]  # axes whose call-time size the hooks read (besides query and key)
    # the context after (N_Q, N_K, GROUP): ("tensor" | "scalar" | "size" | "offsets", name); "offsets": the pointer
    # of a call-time index table, built by the host function `name` in the source (`_Context.offset_table`)
    layout: tuple[tuple[str, str], ...]
    source: str  # the device functions
    description: tuple[str, ...]
    # call-time range tables (mask_table.py) where a direction has no exact compile-time interval: (the mask reads
    # the batch, the head); the hooks `_key_bound`, `_query_bound` are then the compile-time bounds the tables'
    # scan stays inside, and `_key_range`, `_query_range` read the tables at the end of C
    tables: tuple[bool, bool] | None = None
    # the mask hook can hide a (query, key) pair inside the bounds: False for the always-true hook of a score
    # modifier without a mask, whose ranges cover every block (the dQ-from-dS backward reads every tile)
    hides: bool = True

    @property
    def grad_tensors(self) -> tuple[ModTensor, ...]:
        return tuple(t for t in self.tensors if t.float and t.in_score)

    def describe(self) -> list[str]:
        return list(self.description)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The op's extra arguments, in order: the tensors, then the scalars."""
        return tuple(t.name for t in self.tensors) + self.scalars


NONE = Modifiers(False, False, (), (), (), (), "", ())


class _Printer(TritonPrinter):
    """Triton text of a hook expression: symbols by a name table; integers as ints where `ints` (masks, ranges)."""

    def __init__(self, names: dict[str, str], ints: bool = False) -> None:
        super().__init__()
        self.names, self.ints = names, ints
        if ints:  # integer bounds (ranges, masks): Triton's maximum takes no NaN rule there
            self.NAN_ARGUMENT = ""

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        if expr.name not in self.names:
            raise ValueError(f"the hook cannot read {expr.name}")
        return self.names[expr.name]

    def _print_Integer(self, expr: sympy.Integer) -> str:
        return str(int(expr)) if self.ints else super()._print_Integer(expr)

    def _print_And(self, expr: sympy.Basic) -> str:
        return " & ".join(f"({self._print(a)})" for a in expr.args)

    def _print_Or(self, expr: sympy.Basic) -> str:
        return " | ".join(f"({self._print(a)})" for a in expr.args)

    def _print_Not(self, expr: sympy.Basic) -> str:
        return f"(({self._print(expr.args[0])}) == 0)"

    def _print_Relational(self, expr: sympy.Basic) -> str:
        op = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}[expr.rel_op]
        return f"({self._print(expr.lhs)}) {op} ({self._print(expr.rhs)})"

    _print_Equality = _print_Unequality = _print_StrictLessThan = _print_LessThan = _print_Relational
    _print_StrictGreaterThan = _print_GreaterThan = _print_Relational

    def _print_BooleanTrue(self, expr: sympy.Basic) -> str:
        return "True"

    def _print_BooleanFalse(self, expr: sympy.Basic) -> str:
        return "False"

    def _print_Piecewise(self, expr: sympy.Basic) -> str:
        *pieces, (last, _) = expr.args  # sympy closes a Piecewise with a (value, True) piece
        out = self._print(last)
        for value, cond in reversed(pieces):
            out = f"tl.where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _print_floor(self, expr: sympy.Basic) -> str:
        return f"tl.floor({self._print(expr.args[0])})"

    def _print_ceiling(self, expr: sympy.Basic) -> str:
        return f"tl.ceil({self._print(expr.args[0])})"


class _Context:
    """The context tuple's layout and each symbol's text, for one spec."""

    def __init__(self, program: ir.Program, q_axes: tuple[str, ...], k_axes: tuple[str, ...]) -> None:
        self.program = program
        batch, head, query, _ = q_axes
        kv_head = k_axes[1]
        factors = program.axis(head).factors
        self.roles = {batch: BATCH, head: HEAD, query: QUERY, k_axes[2]: KEY}
        if kv_head != head:
            self.roles[kv_head] = KV_HEAD
            if len(factors) == 2:
                self.roles[factors[1]] = GROUP_INDEX
        self.query, self.key = query, k_axes[2]
        self.slots = SLOTS
        self.tensors: dict[str, tuple[ModTensor, int]] = {}
        self.scalars: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.layout: list[tuple[str, str]] = []
        # the call-time index tables (`offset_table`): (host function, the plan's line)
        self.offset_tables: list[tuple[str, str]] = []
        self.offset_slots: dict[sympy.Expr, int] = {}

    def position(self, axis: str, span) -> str:
        role = self.roles.get(axis)
        if role is None or role in (KV_HEAD, GROUP_INDEX):
            raise UnsupportedModifier(span, detail=f"the attention kernels read the positions of the batch, head, "
                                      f"query and key axes; '{axis}' is none of them")
        return _VALUE_TEXT[role]

    def tensor(self, load: ir.Load, in_score: bool) -> tuple[ModTensor, int]:
        tensor = self.program.tensor(load.tensor)
        if tensor.role == "out" or tensor.role == "let":
            raise UnsupportedModifier(load.span, detail=f"a score or mask modifier reads input tensors; "
                                      f"'{load.tensor}' is computed", hint="make it an `in` or `param` tensor")
        roles, texts, positions = [], [], set()
        for index in load.index:
            if index.axis is None and index.index is not None:
                text, read = self.index_text(index.index, load)
                roles.append(INDEX)
                texts.append(text)
                positions |= read
                continue
            role = self.roles.get(index.axis or "")
            if role is None:
                raise UnsupportedModifier(load.span, detail=f"'{load.tensor}' is read over '{index.axis}'; a modifier "
                                          "tensor is indexed by the batch, head, query and key axes only")
            roles.append(role)
            texts.append("")
        known = self.tensors.get(load.tensor)
        if known is not None:
            mod, slot = known
            if mod.roles != tuple(roles) or mod.index != tuple(texts):
                raise UnsupportedModifier(load.span, detail=f"'{load.tensor}' is read at two different indices")
            if (in_score and not mod.in_score) or (not in_score and not mod.in_mask):
                self.tensors[load.tensor] = (dataclasses.replace(mod, in_score=mod.in_score or in_score,
                                                                 in_mask=mod.in_mask or not in_score), slot)
            return self.tensors[load.tensor]
        mod = ModTensor(load.tensor, tuple(roles), tensor.dtype in FLOAT_DTYPES, in_score, tuple(texts),
                        frozenset(positions), in_mask=not in_score)
        self.tensors[load.tensor] = (mod, self.slots)
        self.layout.append(("tensor", load.tensor))
        self.slots += 1 + len(roles)
        return mod, self.slots - 1 - len(roles)

    def scalar(self, name: str) -> str:
        if name not in self.scalars:
            self.scalars[name] = self.slots
            self.slots += 1
            self.layout.append(("scalar", name))
        return f"C[{self.scalars[name]}]"

    def size(self, axis: str) -> str:
        if axis == self.query:
            return "C[5]"
        if axis == self.key:
            return "C[6]"
        if axis not in self.sizes:
            self.sizes[axis] = self.slots
            self.slots += 1
            self.layout.append(("size", axis))
        return f"C[{self.sizes[axis]}]"

    def index_text(self, index: sympy.Expr, load: ir.Load) -> tuple[str, set[str]]:
        """An index expression of positions (ncd/index_expr.py, proven inside its axis) as integer Triton text, and
        the roles it reads. Only exact integer operations: a division or a logarithm in fp32 could pick another
        entry than the float64 reference."""
        from ncd.index_expr import Position

        positions = {s: sympy.Symbol(f"pos_{s.name}", integer=True, nonnegative=True)
                     for s in index.free_symbols if isinstance(s, Position)}
        rounded = any(isinstance(a, sympy.log | sympy.floor | sympy.ceiling) or (isinstance(a, sympy.Pow) and
                                                                                a.exp < 0)
                      for a in sympy.preorder_traversal(index))
        if rounded and not index.free_symbols - set(positions):
            text = self.offset_table(index, load)
            if text is not None:
                return text, {QUERY, KEY}
        if rounded or index.free_symbols - set(positions):
            raise UnsupportedModifier(load.span, detail=f"'{load.tensor}' is read at {index}, which the attention "
                                      "kernels print only from positions, integers, + - *, min, max, clamp and abs "
                                      "(with a division or a log: of key - query alone)",
                                      hint="the generic family compiles it (division and log buckets included)")
        expr = index.subs(positions)
        text = _Printer(self.names(expr, {}), ints=True).doprint(expr)
        return f"({text})", {self.roles[s.name] for s in positions if s.name in self.roles}

    def offset_table(self, index: sympy.Expr, load: ir.Load) -> str | None:
        """An index of key - query alone that divides or takes a log (T5's log buckets) as a read of a call-time
        int32 table over the offsets d = key - query in [1 - N_Q, N_K - 1] (None for any other index). The table is
        computed in float64 by the reference's own walk of the expression, so the kernels read the entry the
        reference reads; the offset is clamped into the table for the tiles' rows and keys past the ends."""
        from ncd.index_expr import LOG_SLACK, Position, torch_code

        by_role = {self.roles.get(s.name): s for s in index.free_symbols if isinstance(s, Position)}
        query, key = by_role.get(QUERY), by_role.get(KEY)
        if query is None or key is None or len(by_role) != 2:
            return None
        offset = sympy.Symbol("offset", integer=True)
        reduced = index.subs(key, query + offset)
        # the conditions of where(...) read key > query as query + offset > query: simplified alone, so that the
        # arithmetic keeps the spec's form (and the reference's rounding)
        relations = reduced.atoms(sympy.core.relational.Relational)
        reduced = reduced.xreplace({r: sympy.simplify(r) for r in relations})
        if reduced.free_symbols != {offset}:
            return None
        i, j = _VALUE_TEXT[QUERY], _VALUE_TEXT[KEY]
        slot = self.offset_slots.get(reduced)
        if slot is not None:  # the same index read again: the same table
            return f"tl.load(C[{slot}] + tl.minimum(tl.maximum({j} - {i} + C[5] - 1, 0), C[5] + C[6] - 2))"
        try:
            code = torch_code(reduced, "_offset")
        except ValueError:
            return None
        name = f"_offsets_{len(self.offset_tables)}"
        self.offset_tables.append((
            f"def {name}(_offset, _device):  # {load.span.origin}: {load.tensor}'s index, of key - query\n"
            f"    # (as the reference: floor(log(...)) takes a value within {LOG_SLACK} of an integer as the integer)\n"
            + fit("_index = ", code) + "\n    return _index.to(torch.int32)",
            f"    index table: {load.tensor} at {index} ({load.span.origin}): an int32 table over key - query, built "
            "at call time in float64 (as the reference)"))
        slot = self.offset_slots[reduced] = self.slots
        self.slots += 1
        self.layout.append(("offsets", name))
        return f"tl.load(C[{slot}] + tl.minimum(tl.maximum({j} - {i} + C[5] - 1, 0), C[5] + C[6] - 2))"

    @staticmethod
    def dimension(mod: ModTensor, d: int) -> str:
        """The index of a tensor's dimension d: its role's position, or its index expression."""
        return mod.index[d] if mod.index and mod.index[d] else _ROLE_TEXT[mod.roles[d]]

    @staticmethod
    def offset(mod: ModTensor, slot: int) -> str:
        """The element offset of a tensor's value at (b, h, i, j), int64 (a bias over four axes passes 2^31)."""
        terms = [f"{_Context.dimension(mod, d)} * C[{slot + 1 + d}]" for d in range(len(mod.roles))]
        first = terms[0].rsplit(" * ", 1)
        terms[0] = f"{first[0]}.to(tl.int64) * {first[1]}" if mod.roles[0] not in (KV_HEAD, GROUP_INDEX) else \
            f"({first[0]}).to(tl.int64) * {first[1]}"
        return " + ".join(terms)

    def names(self, expr: sympy.Basic, loads: dict[str, str], floats: bool = False) -> dict[str, str]:
        """Each symbol of expr as text: X as `s`, positions by role, tensor values by their loaded local, scalar
        inputs and axis sizes from the context (`floats`: sizes as fp32, for tl.log and friends)."""
        sizes = {a.size.name: a.name for a in self.program.axes if isinstance(a.size, sympy.Symbol)}
        scalars = {t.name for t in self.program.inputs if not t.axes}
        out = {}
        for symbol in expr.free_symbols:
            name = symbol.name
            if symbol == X:
                out[name] = "s"
            elif name.startswith("pos_"):
                out[name] = self.position(name[4:], None)
            elif name in loads:
                out[name] = loads[name]
            elif name in sizes:
                out[name] = f"({self.size(sizes[name])} * 1.0)" if floats else self.size(sizes[name])
            elif name in scalars:
                out[name] = self.scalar(name)
        return out


def _loads(ctx: _Context, leaves: tuple[tuple[str, ir.Node], ...], in_score: bool,
           vector: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Lines loading each tensor leaf into a local, and the symbol -> local table. `vector`: a range hook's 1-D
    index ("i" or "j"): only tensors over that position (and batch, head) are loaded, as vectors."""
    lines, table = [], {}
    for k, (name, node) in enumerate(leaves):
        if not isinstance(node, ir.Load):
            continue
        mod, slot = ctx.tensor(node, in_score)
        if vector is not None and ({QUERY, KEY} & mod.reads) - {vector}:
            continue
        local = f"t{k}"
        # bounds only along the positions the tensor has: a per-query value loads once per row of the tile
        bounds = [b for role, b in ((QUERY, "(i < C[0])"), (KEY, "(j < C[1])")) if role in mod.reads]
        mask = f", mask={' & '.join(bounds)}, other=0" if bounds else ""
        # a float tensor is computed with in fp32 whatever dtype the caller passes (its declared f32 holds the
        # 16-bit values exactly; Triton 3.9's interpreter also negates bf16 values wrongly)
        widen = ".to(tl.float32)" if (ctx.program.tensor(node.tensor).dtype or "f32").startswith(("f", "bf")) else ""
        lines.append(fit(f"{local} = ", f"tl.load(C[{slot}] + {ctx.offset(mod, slot)}{mask}){widen}"))
        table[name] = local
    return lines, table


def _hook(name: str, params: str, origin: str, body: list[str], ret: str | None) -> str:
    """A device function; of `body`, only the lines whose local a later line or `ret` reads (no unused loads). No
    `ret`: a procedure, with no return statement (Triton 3.6 cannot compile `return None`)."""
    kept: list[str] = []
    reads = ret or ""
    for line in reversed(body):
        local = line.split("=")[0].strip() if " = " in line and not line.lstrip().startswith("tl.") else None
        if local is None or re.search(rf"\b{re.escape(local)}\b", reads):
            kept.insert(0, line)
            reads += " " + line.split(" = ", 1)[-1]
    return "\n".join(["", "", "@triton.jit", f"def {name}({params}):", f"    # {origin}",
                      *(drop_double_parens(line) for line in kept),
                      fit("return ", drop_double_parens(ret)) if ret is not None else ("" if kept else "    pass")]
                     ).rstrip("\n")


def derive(program: ir.Program, cert: Certificate, q_axes: tuple[str, ...], k_axes: tuple[str, ...],
           mask: ir.Node | None) -> Modifiers:
    """The hooks of a spec's score modifier (cert.modifier) and mask (None: no mask, or the plain causal one that
    the kernels' CAUSAL flag handles)."""
    if cert.modifier is None and mask is None:
        return NONE
    # a score modifier always runs with a mask hook (`true` without a mask): its range hooks leave the last,
    # partial, block of each axis masked, so that no row or key past the end feeds a modified score to the sums
    ctx = _Context(program, q_axes, k_axes)
    parts: list[str] = []
    description: list[str] = []
    origin = cert.span.origin
    if cert.modifier is not None:
        parts += _score_hooks(ctx, cert, origin)
        description.append(f"  score modifier: s' = {_readable(sympy.sstr(cert.modifier), _words(cert.leaves))}  "
                           "(x = scale * q.k)")
    mask_parts, exact = _mask_hooks(ctx, mask, origin, description)
    parts += mask_parts
    tables = None
    if not exact:  # the ranges come from tables built at call time; the compile-time ones bound their scan
        parts = [p.replace("def _key_range(", "def _key_bound(").replace("def _query_range(", "def _query_bound(")
                 for p in parts]
        slot = ctx.slots  # the tables' (pointer, strides) follow everything else in C: rows, then columns
        parts += [_hook("_key_range", "rows, b, h, C", origin, [],
                        f"table_range(C[{slot}], C[{slot + 1}], C[{slot + 2}], C[{slot + 3}], rows, C[0], b, h)"),
                  _hook("_query_range", "rows, b, h, C", origin, [],
                        f"table_range(C[{slot + 4}], C[{slot + 5}], C[{slot + 6}], C[{slot + 7}], rows, C[1], b, h)")]
        tables = _reads_batch_head(ctx, mask)
        description[:] = [d.replace("blocks outside it skipped, every block inside masked", "the call-time tables' "
                                    "scan stays inside it") for d in description]
        description.append("    blocks: from call-time range tables of the mask (mask_table.py: built once per mask "
                           "tensor, inside the bounds above, cached); exact per row and per key")
    for function, line in ctx.offset_tables:  # host functions, beside the device ones
        parts.append("\n\n" + function)
        description.append(line)
    tensors = tuple(mod for mod, _ in sorted(ctx.tensors.values(), key=lambda m: m[1]))
    return Modifiers(cert.modifier is not None, True, tensors,
                     tuple(sorted(ctx.scalars, key=ctx.scalars.__getitem__)),
                     tuple(sorted(ctx.sizes, key=ctx.sizes.__getitem__)), tuple(ctx.layout), "\n".join(parts),
                     tuple(description), tables, hides=mask is not None)


def _reads_batch_head(ctx: _Context, mask: ir.Node | None) -> tuple[bool, bool]:
    """Whether the mask reads the batch and the head position (its tensors' dimensions, or the positions)."""
    roles: set[str] = set()
    for node in ir.walk(mask) if mask is not None else ():
        if isinstance(node, ir.AxisIndex):
            roles.add(ctx.roles.get(node.axis, ""))
        elif isinstance(node, ir.Load) and node.tensor in ctx.tensors:
            roles.update(ctx.tensors[node.tensor][0].reads)
    return BATCH in roles, bool({HEAD, KV_HEAD, GROUP_INDEX} & roles)


def _score_hooks(ctx: _Context, cert: Certificate, origin: str) -> list[str]:
    modifier = cert.modifier
    assert modifier is not None
    lines, table = _loads(ctx, cert.leaves, True)
    try:
        text = _Printer(ctx.names(modifier, table, floats=True)).doprint(modifier)
        dtext = _Printer(ctx.names(modifier, table, floats=True)).doprint(sympy.diff(modifier, X))
    except ValueError as err:
        raise UnsupportedModifier(cert.span, detail=f"cannot lower the score modifier to Triton: {err}") from None
    parts = [_hook("_score", "s, i, j, b, h, C", origin, lines, text),
             _hook("_dscore", "s, i, j, b, h, C", origin, lines, dtext)]
    grads: list[str] = []
    g = 0
    for name, node in cert.leaves:
        if not isinstance(node, ir.Load):
            continue
        mod, _ = ctx.tensors[node.tensor]
        if not mod.float:
            continue
        derivative = sympy.diff(modifier, sympy.Symbol(name, real=True))
        contribution = "ds" if derivative == 1 else \
            f"ds * ({_Printer(ctx.names(derivative, table, floats=True)).doprint(derivative)})"
        offset = " + ".join(f"{_Context.dimension(mod, d)} * G[{g + 1 + d}]" for d in range(len(mod.roles)))
        first, rest = offset.split(" * G[", 1)
        offset = f"({first}).to(tl.int64) * G[{rest}"  # int64: a bias over four axes passes 2^31
        grads.append(f"    d{g} = {contribution}")
        if mod.roles.count(INDEX) == 1 and not {QUERY, KEY} & set(mod.roles):
            # a table read at an expression of positions (T5): the tile's pairs fall in few entries, most often
            # one (every pair more than R apart shares the end bucket), so one reduction and one atomic per entry
            # the tile reads, not one per pair contending for it
            d = mod.roles.index(INDEX)
            at_v = offset.replace(mod.index[d], f"v{g}", 1)
            grads += [f"    idx{g} = {mod.index[d]} + 0 * (i + j)",
                      f"    lo{g} = tl.min(tl.min(tl.where(ok, idx{g}, 2147483647), 1), 0)",
                      f"    hi{g} = tl.max(tl.max(tl.where(ok, idx{g}, -1), 1), 0)",
                      f"    for v{g} in range(lo{g}, hi{g} + 1):",
                      f"        part{g} = tl.sum(tl.sum(tl.where(ok & (idx{g} == v{g}), d{g}, 0.0), 1), 0)",
                      f"        tl.atomic_add(G[{g}] + {at_v}, part{g}, sem=\"relaxed\")"]
        elif {QUERY, KEY} & mod.reads:
            grads += [f"    at{g} = G[{g}] + ({offset}) + 0 * (i + j)",
                      f"    tl.atomic_add(at{g}, d{g}, mask=ok, sem=\"relaxed\")"]
        else:
            grads.append(f"    tl.atomic_add(G[{g}] + {offset}, tl.sum(tl.sum(d{g}, 1), 0), sem=\"relaxed\")")
        g += 1 + len(mod.roles)
    if any("mask=ok" in line or "(ok" in line for line in grads):
        grads.insert(0, "    ok = (i < C[0]) & (j < C[1])")
    parts.append(_hook("_score_grads", "ds, s, i, j, b, h, C, G", origin, lines + grads, None))
    return parts


def _mask_condition(ctx: _Context, mask: ir.Node) -> tuple[sympy.Basic, tuple[tuple[str, ir.Node], ...]]:
    from ncd.symbolic import condition_to_sympy

    scalars = {t.name: t for t in ctx.program.inputs if not t.axes}

    def leaf(n: ir.Node) -> sympy.Expr | None:
        if isinstance(n, ir.AxisIndex) or (isinstance(n, ir.Load) and n.axes
                                           and all(i.axis is not None for i in n.index)):
            return modifier_symbol(ctx.program, n)
        if isinstance(n, ir.Load) and n.tensor in scalars:
            integer = scalars[n.tensor].dtype not in FLOAT_DTYPES
            return sympy.Symbol(n.tensor, integer=True) if integer else sympy.Symbol(n.tensor, real=True)
        if isinstance(n, ir.Const | ir.SizeOf):
            return None
        raise UnsupportedModifier(n.span, detail=f"a mask reads positions, scalar inputs and input tensors; "
                                  f"{type(n).__name__.lower()} is none of them")

    axes = {a.name: a for a in ctx.program.axes}
    cond = condition_to_sympy(mask, axes, leaf=leaf)
    return cond, modifier_leaves(cond, ctx.program, mask)


def _mask_hooks(ctx: _Context, mask: ir.Node | None, origin: str, description: list[str]) -> tuple[list[str], bool]:
    """The MASK hook and both range hooks, and whether both ranges are exact."""
    cond, leaves = _mask_condition(ctx, mask) if mask is not None else (sympy.true, ())
    lines, table = _loads(ctx, leaves, False)
    try:
        text = _Printer(ctx.names(cond, table), ints=True).doprint(cond)
    except ValueError as err:
        raise UnsupportedModifier(mask.span if mask is not None else None,
                                  detail=f"cannot lower the mask to Triton: {err}") from None
    parts = [_hook("_mask", "i, j, b, h, C", origin, lines, text)]
    i = sympy.Symbol(f"pos_{ctx.query}", integer=True, nonnegative=True)  # (as streaming.modifier_symbol makes them)
    j = sympy.Symbol(f"pos_{ctx.key}", integer=True, nonnegative=True)
    per: dict[str, set[str]] = {QUERY: set(), KEY: set()}  # symbols of tensors that vary along the query / key
    for name, node in leaves:
        if isinstance(node, ir.Load):
            for role in (QUERY, KEY):
                if role in ctx.tensors[node.tensor][0].reads:
                    per[role].add(name)
    symbols = {s.name: s for s in cond.free_symbols}
    words = _words(leaves)
    sizes = frozenset(a.name for a in ctx.program.axes if isinstance(a.size, sympy.Symbol))
    shown = _readable(sympy.sstr(cond), words, sizes) if mask is not None else "none (bounds only)"
    description.append(f"  mask: {shown}")
    all_exact = True
    for label, (row, col, role) in (("keys", (i, j, KEY)), ("queries", (j, i, QUERY))):
        interval, exact = _interval(cond, row, col, frozenset(symbols[n] for n in per[role] if n in symbols))
        all_exact = all_exact and exact
        text = _readable(describe(interval, ctx.key if role == KEY else ctx.query), words, sizes) \
            if interval is not None \
            else "not one interval at compile time"
        description.append(f"    {label}: {text}" + ("" if exact or interval is None else
                                                     " (outer bound of the conjuncts that are intervals: blocks "
                                                     "outside it skipped, every block inside masked)"))
        name, rows, n_rows, n_cols, shift = ("_key_range", QUERY, "C[0]", "C[1]", "C[4]") if role == KEY else \
            ("_query_range", KEY, "C[1]", "C[0]", "C[3]")
        parts.append(_range_hook(ctx, name, interval, exact, leaves, rows, n_rows, n_cols, shift, origin))
    return parts, all_exact


def _interval(cond: sympy.Basic, row: sympy.Symbol, col: sympy.Symbol, dependent: frozenset
              ) -> tuple[Interval | None, bool]:
    """(interval, exact): the mask's exact visible interval; else, for a conjunction, the interval of the
    conjuncts that have one, which contains the visible set (the kernels then skip blocks outside it and mask
    every block inside: document masking within causal skips the blocks past the diagonal)."""
    exact = visible_interval(cond, row, col, dependent)
    if exact is not None or not isinstance(cond, sympy.And):
        return exact, exact is not None
    kept = [a for a in cond.args if visible_interval(a, row, col, dependent) is not None]
    if not kept:
        return None, False
    return visible_interval(sympy.And(*kept, evaluate=False), row, col, dependent), False


def _words(leaves: tuple[tuple[str, ir.Node], ...]) -> dict[str, str]:
    """Each tensor symbol as the spec reads it: `q_doc[batch query]`, `table[head, Min(16, ...) + 16]`."""
    return {name: (f"{node.tensor}[{' '.join(i.axis or '' for i in node.index)}]"
                   if all(i.axis for i in node.index) else
                   f"{node.tensor}[{', '.join(i.axis or sympy.sstr(i.index) for i in node.index)}]")
            for name, node in leaves if isinstance(node, ir.Load)}


def _readable(text: str, words: dict[str, str], sizes: frozenset[str] = frozenset()) -> str:
    """A condition or interval in the spec's words: pos_key -> key, t_q_doc_batch_query -> q_doc[batch query], and
    an axis's call-time size symbol (`sizes`) -> size(key)."""
    head, sep, text = text.partition(" in ") if re.match(r"\w+ in ", text) else ("", "", text)
    if sizes:  # (first: the bare names; "_" joins the others' parts, so \b finds no axis inside them)
        text = re.sub(r"\b(" + "|".join(map(re.escape, sorted(sizes))) + r")\b", r"size(\1)", text)
    text = re.sub(r"\bt_\w+", lambda m: words.get(m.group(0), m.group(0)), text)
    return head + sep + re.sub(r"\bpos_(\w+)", r"\1", text)


def _range_hook(ctx: _Context, name: str, interval, exact: bool, leaves, row: str, n_rows: str, n_cols: str,
                shift: str, origin: str) -> str:
    """(lo, full_lo, full_hi, hi) over a block of rows (`rows`, a vector of the call's indices along `row`); without
    an exact interval no block is full. The interval bounds positions in the whole sequence: `shift` (the columns'
    offset) takes them back to the call's columns, clipped to [0, n_cols]."""
    params = "rows, b, h, C"
    everything = _hook(name, params, origin, ["    zero = tl.min(rows, 0) * 0"], f"zero, zero, zero, zero + {n_cols}")
    if interval is None:
        return everything
    lines, table = _loads(ctx, leaves, False, vector=row)
    lines = [f"    {row} = rows", *lines]
    exprs = {}
    for label, value in (("lower", interval.lower), ("upper", interval.upper), ("gate", interval.gate)):
        if value is None:
            continue
        try:
            exprs[label] = _Printer(ctx.names(value, table), ints=True).doprint(value)
        except ValueError:  # a bound the printer has no Triton for (a Piecewise): no skipping, still exact
            return everything
    lower = f"({exprs['lower']}) - {shift} + 0 * rows" if "lower" in exprs else "0 * rows"
    upper = f"({exprs['upper']}) + 1 - {shift} + 0 * rows" if "upper" in exprs else f"{n_cols} + 0 * rows"
    gate = exprs.get("gate", "True")
    lines += [fit("lower = ", f"tl.minimum(tl.maximum(({lower}).to(tl.int32), 0), {n_cols})"),
              fit("upper = ", f"tl.minimum(tl.maximum(({upper}).to(tl.int32), 0), {n_cols})"),
              f"    in_range = rows < {n_rows}",
              f"    valid = in_range & ({gate})" if gate != "True" else "    valid = in_range",
              f"    lo = tl.min(tl.where(valid, lower, {n_cols}), 0)",
              "    hi = tl.max(tl.where(valid, upper, 0), 0)",
              "    full_lo = tl.max(tl.where(valid, lower, 0), 0)",
              f"    full_hi = tl.min(tl.where(valid, upper, {n_cols}), 0)",
              "    gated = tl.max((in_range & (valid == 0)).to(tl.int32), 0)",  # a row that sees no key at all
              "    full_hi = tl.where(gated > 0, full_lo, full_hi)" if exact else "    full_hi = full_lo"]
    return _hook(name, params, origin, lines, "lo, full_lo, full_hi, hi")

