"""The boolean operators `and`, `or`, `not` (docs/language.md §8): Python's precedence below comparisons, names that
merely start with them stay names, the words themselves are reserved, operands must be conditions (located type
errors), the float64 reference evaluates them in attention masks (integer tensors, scalar inputs, axis positions,
fully masked rows), the generic family compiles them, and `condition_to_sympy` turns them into sympy booleans."""

from __future__ import annotations

import itertools

import pytest
import sympy
import torch

from ncd import ast, ir
from ncd.backend import op_id
from ncd.errors import InvalidIdentifier, TypeMismatch
from ncd.families.generic import plan_generic
from ncd.parser import parse
from ncd.pipeline import front_end
from ncd.printer import format_ir, format_node
from ncd.reference import evaluate
from ncd.symbolic import condition_to_sympy


def _value(text: str) -> ast.Expr:
    """The AST of the expression `text` (the right-hand side of an output)."""
    stmt = parse(f"out y = {text}\n").statements[0]
    assert isinstance(stmt, ast.TensorDecl) and stmt.value is not None
    return stmt.value


def _shape(e: object) -> object:
    """An AST expression as nested tuples: operators and names only (no spans)."""
    if isinstance(e, ast.Binary):
        return (e.op, _shape(e.lhs), _shape(e.rhs))
    if isinstance(e, ast.Not):
        return ("not", _shape(e.operand))
    if isinstance(e, ast.NameRef):
        return e.name
    if isinstance(e, ast.Number):
        return e.value
    if isinstance(e, ast.Neg):
        return ("neg", _shape(e.operand))
    raise AssertionError(f"unexpected {type(e).__name__}")


# --- grammar -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "grouping"), [
    ("not a < b or c == d and e > f", ("or", ("not", ("<", "a", "b")), ("and", ("==", "c", "d"), (">", "e", "f")))),
    ("a < b and c >= d", ("and", ("<", "a", "b"), (">=", "c", "d"))),
    ("a < b or c < d or e < f", ("or", ("or", ("<", "a", "b"), ("<", "c", "d")), ("<", "e", "f"))),
    ("a < b and (c < d or e < f)", ("and", ("<", "a", "b"), ("or", ("<", "c", "d"), ("<", "e", "f")))),
    ("not (a < b and c < d)", ("not", ("and", ("<", "a", "b"), ("<", "c", "d")))),
    ("not not a + 1 < -b", ("not", ("not", ("<", ("+", "a", 1), ("neg", "b"))))),
])
def test_precedence_is_pythons(text, grouping):
    """`not` binds tighter than `and`, `and` tighter than `or`, all three looser than comparisons and arithmetic;
    parentheses group."""
    assert _shape(_value(text)) == grouping


def test_names_that_start_with_a_keyword_stay_names():
    """Lark turns a NAME whose whole text is a keyword into the keyword; `order`, `notes`, `android` stay names."""
    front = front_end("spec nameplay\naxis order, notes\nin android[order notes] : f32\nin nothing[order] : f32\n"
                      "out origin[order notes] = where(android > nothing and not notes == order, android, nothing)\n",
                      "nameplay.ncd")
    assert [t.name for t in front.program.tensors] == ["android", "nothing", "origin"]
    cond = front.program.definitions[0].value.cond  # type: ignore[attr-defined]
    assert isinstance(cond, ir.Binary) and cond.op == "and" and isinstance(cond.rhs, ir.Unary)
    assert isinstance(cond.rhs.arg, ir.Binary) and cond.rhs.arg.axes == ("notes", "order")


@pytest.mark.parametrize(("line", "col", "word"), [
    ("axis and", 6, "and"),
    ("in or[batch] : f32", 4, "or"),
    ("const not = 2", 7, "not"),
    ("out not[batch] = x", 5, "not"),
    ("and[batch] = x", 1, "and"),
])
def test_keywords_are_reserved_with_a_location(line, col, word):
    text = f"spec reserved\naxis batch\nin x[batch] : f32\n{line}\nout y[batch] = x\n"
    with pytest.raises(InvalidIdentifier) as err:
        front_end(text, "reserved.ncd")
    assert (err.value.span.line, err.value.span.col) == (4, col)
    rendered = err.value.render()
    assert rendered.startswith(f"reserved.ncd:4:{col}: error[invalid-name]: '{word}' cannot be used as a name: "
                               "it is a keyword of the spec language")
    assert line in rendered and "^" * len(word) in rendered


# --- type checking -------------------------------------------------------------------------------------------------

TYPED = "spec typed\naxis batch, chan\nin x[batch chan] : f32\nin y[batch] : f32\n"


@pytest.mark.parametrize(("line", "col", "detail"), [
    ("out z[batch chan] = where(x and y > 0, x, 0)", 27, "'and' combines conditions"),
    ("out z[batch chan] = where(x > 0 or y, x, 0)", 36, "'or' combines conditions"),
    ("out z[batch chan] = where(not x, x, 0)", 31, "'not' combines conditions"),
    ("out z[batch chan] = where(x > 0 and y + 1, x, 0)", 37, "'and' combines conditions"),
])
def test_a_number_operand_is_a_located_type_error(line, col, detail):
    with pytest.raises(TypeMismatch) as err:
        front_end(TYPED + line + "\n", "typed.ncd")
    rendered = err.value.render()
    assert rendered.startswith(f"typed.ncd:5:{col}: error[type]: {detail}")
    assert "= help: compare first: x > 0 and y > 0" in rendered


@pytest.mark.parametrize(("line", "col", "detail"), [
    ("out z[batch chan] = x + (x > 0 and y > 0)", 26, "a condition (and/or/not) cannot be used as a number"),
    ("out z[batch chan] = x > 0 or not y > 0", 21, "'z' is a condition (true/false)"),
    ("out z[batch chan] = exp(not x > 0)", 25, "a condition (and/or/not) cannot be used as a number"),
    ("out z[batch chan] = where(x + 1, x, 0)", 27, "where()'s first argument must be a comparison"),
])
def test_a_condition_used_as_a_number_stays_an_error(line, col, detail):
    with pytest.raises(TypeMismatch) as err:
        front_end(TYPED + line + "\n", "typed.ncd")
    assert err.value.render().startswith(f"typed.ncd:5:{col}: error[type]: {detail}")


def test_result_axes_are_merged_and_every_form_is_boolean():
    front = front_end(TYPED + "out z[batch chan] = where(x > 0 and not y < 1 or chan == 0, x, 0)\n", "typed.ncd")
    cond = front.program.definitions[0].value.cond  # type: ignore[attr-defined]
    assert isinstance(cond, ir.Binary) and cond.op == "or" and cond.boolean
    conj = cond.lhs
    assert isinstance(conj, ir.Binary) and conj.op == "and" and conj.boolean and conj.axes == ("batch", "chan")
    negation = conj.rhs
    assert isinstance(negation, ir.Unary) and negation.fn == "not" and negation.boolean
    assert negation.axes == ("batch",) and cond.rhs.axes == ("chan",) and cond.axes == ("batch", "chan")
    assert not ir.Unary("neg", negation.arg, negation.axes, negation.span).boolean
    assert format_node(cond) == "x[batch chan] > 0 and not y[batch] < 1 or #chan == 0"
    grouped = ir.Unary("not", ir.Binary("and", cond.rhs, cond.rhs, ("chan",), cond.span), ("chan",), cond.span)
    assert format_node(grouped) == "not (#chan == 0 and #chan == 0)"


# --- attention masks in the float64 reference ----------------------------------------------------------------------

ATTENTION = """spec masked_attention
axis batch, head, query, key
axis dim = 3
in Q[batch head query dim] : f32
in K[batch head key dim] : f32
in V[batch head key dim] : f32
in window : i32 = 2
in kv_len[batch] : i32
in prefix[batch] : i32
in q_doc[batch query] : i32
in k_doc[batch key] : i32
S[batch head query key] = 0.5 * (Q . K over dim)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = {mask})
out O[batch head query dim] = A . V over key
"""
SIZES = {"batch": 2, "head": 3, "query": 5, "key": 7}


def _direct_mask(name: str, inputs: dict[str, torch.Tensor], window: int) -> torch.Tensor:
    """The mask [batch 1 query key] written directly in torch."""
    q = torch.arange(SIZES["query"])[None, None, :, None]
    k = torch.arange(SIZES["key"])[None, None, None, :]
    per_batch = {n: inputs[n][:, None, None, None] for n in ("kv_len", "prefix")}
    if name in ("window", "window_not"):
        return (k <= q) & (k > q - window)
    if name == "kv_len":
        return k < per_batch["kv_len"]
    if name == "document":
        return (inputs["q_doc"][:, None, :, None] == inputs["k_doc"][:, None, None, :]) & (k <= q)
    if name == "prefix":
        return (k <= q) | (k < per_batch["prefix"])
    raise AssertionError(name)


def _direct_attention(inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention; a row with no visible key gives 0."""
    s = 0.5 * inputs["Q"] @ inputs["K"].transpose(-1, -2)
    top = s.masked_fill(~mask, -torch.inf).amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0)) * mask
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z == 0, 1.0, z) @ inputs["V"]


MASKS = {
    "window": "key <= query and key > query - window",
    "window_not": "not (key > query or key <= query - window)",  # docs/language.md §8: the same window
    "kv_len": "key < kv_len",
    "document": "q_doc == k_doc and key <= query",
    "prefix": "key <= query or key < prefix",
}


def _attention_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, n, m, d = SIZES["batch"], SIZES["head"], SIZES["query"], SIZES["key"], 3
    inputs = {name: torch.randn(shape, generator=gen, dtype=torch.float64)
              for name, shape in (("Q", (b, h, n, d)), ("K", (b, h, m, d)), ("V", (b, h, m, d)))}
    inputs["kv_len"] = torch.tensor([0, 4], dtype=torch.int32)  # batch 0: every key masked
    inputs["prefix"] = torch.tensor([3, 0], dtype=torch.int32)
    inputs["q_doc"] = torch.tensor([[9, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.int32)  # (0, 0): no key of doc 9
    inputs["k_doc"] = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 1]], dtype=torch.int32)
    return inputs


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("name", list(MASKS))
def test_reference_evaluates_masks(name, window):
    """Masks of axis positions, a scalar input (at its default, or given), per-batch and per-position integer
    tensors: the reference's output and Q/K/V gradients equal masked softmax attention written directly; a row
    where every key is masked gives 0 and passes no gradient."""
    front = front_end(ATTENTION.format(mask=MASKS[name]), "masked_attention.ncd")
    inputs = _attention_inputs(seed=len(name))
    given: dict[str, torch.Tensor | float] = dict(inputs)
    if window is not None:
        given["window"] = window
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("Q", "K", "V")}
    out = evaluate(front.program, {**given, **leaves})["O"]
    mask = _direct_mask(name, inputs, 2 if window is None else window)
    direct_leaves = {n: inputs[n].clone().requires_grad_() for n in ("Q", "K", "V")}
    want = _direct_attention({**inputs, **direct_leaves}, mask)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad(out, list(leaves.values()), grad_out)
    expected = torch.autograd.grad(want, list(direct_leaves.values()), grad_out)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    empty = ~mask.expand(-1, SIZES["head"], SIZES["query"], -1).any(-1)  # [batch head query]: no visible key
    assert mask.any() and (~mask).any()
    if name in ("kv_len", "document"):
        assert empty.any()
        assert (out[empty] == 0).all() and (got[0][empty] == 0).all()


def test_masks_print_readably():
    front = front_end(ATTENTION.format(mask="not (key > query or key <= query - window) and q_doc == k_doc"),
                      "masked_attention.ncd")
    text = format_ir(front.program)
    assert "mask = not (#key > #query or #key <= #query - window[]) and q_doc[batch query] == k_doc[batch key])" in text


# --- the generic family ------------------------------------------------------------------------------------------

GENERIC = """spec boolean_select
axis batch, chan
in x[batch chan] : f32
in y[batch] : f32
in n_valid[batch] : i32
in limit : f32 = 0.5
a[batch chan] = where(not x < 0 or x > y and chan >= 2, x, 0.5 * x)
p[batch chan] = normalize(x, over chan, a1(v) = exp(v), a2(v) = exp(v), b(z) = z,
                          mask = chan < n_valid and not (x > limit and chan == 0))
out z[batch chan] = a + p
"""


def _generic_function(front):
    namespace: dict = {"__name__": "generic_boolean"}
    source = plan_generic(front, {}).render(front.program, op_id(front))
    exec(compile(source, "generic_boolean", "exec"), namespace)
    return namespace[front.program.name], source


def test_generic_family_compiles_and_or_not():
    """where() with and/or/not and a normalize mask of an integer input and a scalar input: the generic family's
    op (torch.logical_and / logical_or / logical_not) matches the masks written directly, forward and backward,
    including a fully masked row."""
    front = front_end(GENERIC, "boolean_select.ncd")
    fn, source = _generic_function(front)
    assert "torch.logical_and(" in source and "torch.logical_or(" in source and "torch.logical_not(" in source
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    x[0, 0] = 1.0  # masked by `x > limit and chan == 0`
    y = torch.randn(3, generator=gen, dtype=torch.float64)
    n_valid = torch.tensor([4, 0, 7], dtype=torch.int32)  # batch 1: every entry masked
    leaf = x.float().requires_grad_()
    out = fn(leaf, y.float(), n_valid)
    direct_leaf = x.clone().requires_grad_()
    chan = torch.arange(7)
    picked = torch.where(~(direct_leaf < 0) | ((direct_leaf > y[:, None]) & (chan >= 2)), direct_leaf,
                         0.5 * direct_leaf)
    mask = (chan < n_valid[:, None]) & ~((direct_leaf > 0.5) & (chan == 0))
    top = direct_leaf.masked_fill(~mask, -torch.inf).amax(-1, keepdim=True).detach()
    e = torch.exp(direct_leaf - torch.where(torch.isfinite(top), top, 0.0)) * mask
    z = e.sum(-1, keepdim=True)
    want = picked + e / torch.where(z == 0, 1.0, z)
    assert not mask[1].any() and not mask[0, 0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    ref = evaluate(front.program, {"x": x, "y": y, "n_valid": n_valid})["z"]
    torch.testing.assert_close(ref, want.detach(), rtol=1e-12, atol=1e-12)
    grad_out = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, [leaf], grad_out.float())
    (expected,) = torch.autograd.grad(want, [direct_leaf], grad_out)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


# --- condition_to_sympy -------------------------------------------------------------------------------------------


def test_condition_to_sympy_round_trip():
    """A mask becomes And/Or/Not of relationals through the caller's leaf hook (positions and scalar inputs as
    symbols, a per-batch tensor as a symbol), and agrees with the reference's evaluation at every position."""
    front = front_end(ATTENTION.format(mask="key <= query and key > query - window or not key < kv_len"),
                      "masked_attention.ncd")
    normalize = front.program.definition("A").value
    assert isinstance(normalize, ir.Normalize) and normalize.mask is not None
    symbols = {name: sympy.Symbol(name, integer=True) for name in ("query", "key", "window", "kv_len")}

    def leaf(node: ir.Node) -> sympy.Expr | None:
        if isinstance(node, ir.AxisIndex):
            return symbols[node.axis]
        if isinstance(node, ir.Load):
            return symbols[node.tensor]
        return None

    cond = condition_to_sympy(normalize.mask, {a.name: a for a in front.program.axes}, leaf=leaf)
    q, k, w, n = (symbols[s] for s in ("query", "key", "window", "kv_len"))
    # unevaluated: the spec's structure as written (`not key < kv_len` stays a Not); .subs evaluates
    assert cond == sympy.Or(sympy.And(sympy.Le(k, q), sympy.Gt(k, q - w)), sympy.Not(sympy.Lt(k, n), evaluate=False))
    assert isinstance(cond, sympy.Or) and any(isinstance(a, sympy.Not) for a in cond.args)
    for query, key, window, kv_len in itertools.product(range(4), range(5), (1, 2), (0, 3)):
        value = bool(cond.subs({q: query, k: key, w: window, n: kv_len}))
        assert value == ((key <= query and key > query - window) or not key < kv_len)
    for op, relation in (("==", sympy.Eq), ("!=", sympy.Ne), (">=", sympy.Ge)):
        node = ir.Binary(op, ir.AxisIndex("key", normalize.span), ir.Const(2.0, normalize.span), ("key",),
                         normalize.span)
        assert condition_to_sympy(node, leaf=leaf) == relation(k, 2)
    with pytest.raises(TypeError, match="not a condition"):
        condition_to_sympy(ir.AxisIndex("key", normalize.span), leaf=leaf)


def test_generic_module_of_a_masked_attention_spec_is_ruff_clean_and_takes_integer_inputs():
    """The masked attention spec through the generic family: the output `O` (ruff's E741) is kept by a file-level
    noqa, the i32 inputs are passed as int32 tensors (not cast by the caller), and the op matches the reference."""
    from ncd.errors import CallError
    from ncd.lint import lint_generated

    front = front_end(ATTENTION.format(mask=MASKS["document"]), "masked_attention.ncd")
    fn, source = _generic_function(front)
    assert "# ruff: noqa: E741" in source and lint_generated(source, "masked_attention") == []
    inputs = _attention_inputs(seed=2)
    floats = {n: inputs[n].float() for n in ("Q", "K", "V")}
    integers = {n: inputs[n] for n in ("kv_len", "prefix", "q_doc", "k_doc")}
    out = fn(**floats, **integers)
    assert out.dtype == torch.float32 and inputs["q_doc"].dtype == torch.int32
    want = evaluate(front.program, inputs)["O"]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(CallError, match=r"q_doc has dtype torch\.complex64; it is declared i32"):
        fn(**floats, **{**integers, "q_doc": integers["q_doc"].to(torch.complex64)})


def test_an_inline_function_parameter_named_like_a_later_tensor_is_no_dependency():
    """`b(z) = z` reads its parameter, not the tensor `z` defined from it: no false cycle (this spec used to fail
    with "'p' depends on itself: p -> z -> p")."""
    front = front_end("spec shadow\naxis batch, chan\nin x[batch chan] : f32\n"
                      "p[batch chan] = normalize(x, over chan, a1(v) = v^2, a2(v) = v^2, b(z) = z)\n"
                      "out z[batch chan] = p + 1\n", "shadow.ncd")
    assert [d.tensor for d in front.program.definitions] == ["p", "z"]


@pytest.mark.parametrize(("line", "col", "token"), [
    ("out y[batch chan] = where(x > 0 ory > 0, x, 0)", 33, "ory"),
    ("out y[batch chan] = where(x > 0 andy > 0, x, 0)", 33, "andy"),
    ("out y[batch chan] = x ordinal", 23, "ordinal"),
    ("out y[batch] = x . x overchan", 22, "overchan"),
    ("out y[batch chan] = sum(x forj in 0..2)", 27, "forj"),
])
def test_a_keyword_glued_to_a_name_is_a_syntax_error_not_two_tokens(line, col, token):
    """Where a keyword may follow an operand and a name may not, `ory` is the name `ory` (a syntax error there), never
    `or y`: keywords are whole words."""
    from ncd.errors import SpecSyntaxError

    with pytest.raises(SpecSyntaxError) as err:
        front_end(TYPED + line + "\n", "typed.ncd")
    assert err.value.render().startswith(f"typed.ncd:5:{col}: error[syntax]: unexpected '{token}'")


def test_conditions_inside_an_inline_function():
    """and/or/not in a where() of normalize's a1 (the scalar paths of the reference and of the generic family)."""
    front = front_end("spec lam_bool\naxis batch, chan\nin x[batch chan] : f32\nout y[batch chan] = normalize(x, "
                      "over chan, a1(v) = where(not v < 0 and v < 2 or v < -1, v^2, 1), a2(v) = v^2 + 1, b(z) = z)\n",
                      "lam_bool.ncd")
    fn, _ = _generic_function(front)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2
    a1 = torch.where((~(x < 0) & (x < 2)) | (x < -1), x**2, 1.0)
    want = a1 / (x**2 + 1).sum(-1, keepdim=True)
    torch.testing.assert_close(evaluate(front.program, {"x": x})["y"], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fn(x.float()).double(), want, rtol=1e-5, atol=1e-6)
