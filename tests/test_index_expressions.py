"""Tensor reads at an integer expression of positions (ncd/index_expr.py): the T5 relative-position bias
`table[head, clamp(key - query, -16, 16) + 16]` and T5's log buckets, through the float64 reference and the generic
family (forward and the gradient into the table), against hand-written PyTorch; the located errors for indices the
compiler cannot prove inside their axis or that are not integer expressions."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import sympy
import torch

import ncd
from ncd import ast, ir
from ncd.backend import plan
from ncd.errors import IndexOutOfRange, NcdError, SpecSyntaxError, TypeMismatch
from ncd.index_expr import IndexNotProven, position
from ncd.parser import parse
from ncd.pipeline import front_end
from ncd.reference import evaluate
from ncd.validate import check_op

ROOT = Path(__file__).resolve().parent.parent
T5_SPEC = ROOT / "specs" / "t5_bias_softmax.ncd"
B, H, NQ, NK, D, R = 2, 3, 37, 29, 64, 16

HEADER = """axis batch, head, query, key
axis dim = 8
axis rel = 33
in Q[batch head query dim] : f32
in K[batch head key dim] : f32
param table[head rel] : f32
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("index-cache")


def _load(path: Path, cache: Path) -> ncd.ops.Op:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the attention family's decline, reported as a FallbackWarning
        return ncd.load(path, cache_dir=cache)


def _inputs(seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"Q": (B, H, NQ, D), "K": (B, H, NK, D), "V": (B, H, NK, D), "table": (H, 2 * R + 1)}
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in shapes.items()}


def _t5_by_hand(Q, K, V, table):
    """The T5-biased causal softmax attention written directly in PyTorch (float64)."""
    i, j = torch.arange(NQ)[:, None], torch.arange(NK)[None, :]
    bias = table[:, (j - i).clamp(-R, R) + R]  # [head query key]
    s = Q @ K.transpose(-1, -2) / math.sqrt(D) + bias
    s = s.masked_fill(j > i, -math.inf)
    return torch.softmax(s, -1) @ V


def _error(text: str, filename: str = "bad.ncd") -> NcdError:
    with pytest.raises(NcdError) as info:
        front_end(text, filename)
    return info.value


def _caret(err: NcdError) -> tuple[str, str]:
    """The quoted spec line and the caret line under it, from the rendered error."""
    lines = str(err).splitlines()
    at = next(k for k, line in enumerate(lines) if line.lstrip().startswith("^"))
    return lines[at - 1], lines[at]


# --- the front end ----------------------------------------------------------------------------------------------


def test_index_expression_parses_beside_the_simple_forms():
    module = parse("axis a\nin T[a] : f32\nout y[a] = T[a] + T[a -1] + T[2 * a] + T[a, -1]\n")
    value = module.statements[-1].value
    plain, minus, times, two = value.lhs.lhs.lhs, value.lhs.lhs.rhs, value.lhs.rhs, value.rhs
    assert [type(i) for i in plain.indices] == [ast.IndexName]
    assert isinstance(minus.indices[0], ast.IndexOffset) and minus.indices[0].offset == -1  # `a -1` is a - 1
    assert isinstance(times.indices[0], ast.IndexExpr) and isinstance(times.indices[0].expr, ast.Binary)
    assert [type(i) for i in two.indices] == [ast.IndexName, ast.IndexExpr]  # `a, -1`: a second entry


def test_positions_read_by_an_index_are_wires_of_the_load():
    front = front_end(T5_SPEC.read_text(), T5_SPEC.name)
    load = next(n for n in ir.walk(front.program.definition("S").value)
                if isinstance(n, ir.Load) and n.tensor == "table")
    assert load.axes == ("head", "query", "key")
    index = load.index[1].index
    assert load.index[0] == ir.LoadIndex("head") and load.index[1].axis is None
    k, q = position("key"), position("query")
    assert sympy.simplify(index - (sympy.Min(sympy.Max(k - q, -R), R) + R)) == 0
    broken = replace(load, axes=("head", "query"))  # the verifier recomputes the wires from the index
    bad = replace(front.program, definitions=(replace(front.program.definition("S"), value=broken),
                                              *front.program.definitions[1:]))
    with pytest.raises(ir.IRVerificationError, match="disagrees with its index"):
        bad.verify()


@pytest.mark.parametrize("body, error, words, at", [
    # call-time sizes: key - query + 16 reaches 17 - size(query) < 0 once a sequence is longer than 17
    ("table[head, key - query + 16]", IndexNotProven, "bounds it by [17 - size(query), size(key) + 15]",
     "key - query + 16"),
    ("table[head, clamp(key - query, -16, 16) + 17]", IndexNotProven, "not provably inside axis 'rel' of size 33",
     "clamp(key"),
    ("table[head, key / 2]", TypeMismatch, "the index key / 2 of 'table' may not be an integer", "key / 2"),
    ("table[head, clamp(exp(key), 0, 32)]", TypeMismatch, "'exp' cannot be used in an index", "exp"),
    ("table[head, clamp(table[head, 0], 0, 32)]", TypeMismatch, "cannot be part of an index", "table[head, 0]"),
    ("table[head, min(key, w)]", TypeMismatch, "an index reads integer scalar inputs; 'w' is f32", "w)]"),
    ("table[head, where(key, 1, 0)]", TypeMismatch, "first argument must be a comparison", "key, 1"),
    ("table[head, min(key, 3, over key)]", TypeMismatch, "reductions (over ...) cannot be part of an index",
     "min(key"),
])
def test_bad_indices_are_located_errors_with_a_caret(body, error, words, at):
    line = f"out S[batch head query key] = {body} + (Q . K over dim)"
    err = _error(HEADER + "in w : f32 = 1\n" + line + "\n")
    assert type(err) is error, str(err)
    assert words in err.message, err.message
    assert (err.span.line, err.span.col) == (8, line.index(at, 40) + 1), str(err)
    quoted, caret = _caret(err)
    assert quoted.strip() == line
    assert caret.index("^") == quoted.index(at, 40)  # the caret under the spec's own words


def test_an_exactly_out_of_range_index_names_the_value_and_the_clamp():
    err = _error("axis n = 8\nin x[n] : f32\nout y[n] = x[n + 1]\n")
    assert isinstance(err, IndexOutOfRange)
    assert err.message == "index n + 1 of 'x' can reach 8, outside axis 'n' of size 8"
    assert err.hint == "clamp it: clamp(n + 1, 0, 7)"
    assert (err.span.line, err.span.col) == (3, 14)


def test_a_basis_rule_takes_no_index_expression():
    err = _error("axis row\nin x[row] : f32\nbasis T(u) { T[0] = 1; T[1] = u; T[2*n] = u }\nout y[row] = T[1](x)\n")
    assert isinstance(err, SpecSyntaxError) and "basis rule defines" in err.message
    assert (err.span.line, err.span.col) == (3, 36)


def test_clamp_is_an_element_wise_function_too():
    front = front_end("axis row\nin x[row] : f32\nout y[row] = clamp(x, -1, 0.5)\n", "clamped.ncd")
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    assert torch.equal(evaluate(front.program, {"x": x})["y"], x.clamp(-1, 0.5))


# --- values: the float64 reference and the generic family ---------------------------------------------------------


def test_reference_matches_hand_written_t5_attention_and_its_table_gradient():
    front = front_end(T5_SPEC.read_text(), T5_SPEC.name)
    inputs = _inputs(seed=1)
    leaves = {n: v.clone().requires_grad_() for n, v in inputs.items()}
    got = evaluate(front.program, leaves)["O"]
    hand = {n: v.clone().requires_grad_() for n, v in inputs.items()}
    want = _t5_by_hand(**hand)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (got * dout).sum().backward()
    (want * dout).sum().backward()
    for name in ("Q", "K", "V", "table"):
        torch.testing.assert_close(leaves[name].grad, hand[name].grad, rtol=1e-10, atol=1e-12)
    assert float(hand["table"].grad[:, 0].abs().sum()) > 0  # the clamped end bucket is read (|j - i| > 16)


@pytest.mark.parametrize("family", ["attention", "generic"])
def test_t5_forward_and_table_gradient_match_the_reference(cache, family):
    """The attention kernels (a gather hook; the table's gradient by atomics at the index read) and the generic
    family (an advanced-indexing gather, autograd), fp32 against the float64 reference, outputs NaN-poisoned."""
    op = _load(T5_SPEC, cache)
    front = op.front
    assert plan(front).family == "attention"
    if family == "generic":
        from ncd.backend import op_id
        from ncd.families.generic import plan_generic

        namespace: dict = {"__name__": "generic_t5"}
        exec(compile(plan_generic(op.front, {}).render(op.front.program, op_id(op.front)), "generic_t5", "exec"),
             namespace)
        op = namespace["t5_bias_softmax"]
    inputs = _inputs(seed=3)
    leaves = {n: v.float().requires_grad_() for n, v in inputs.items()}
    out = op(leaves["Q"], leaves["K"], leaves["V"], leaves["table"])
    ref_leaves = {n: v.clone().requires_grad_() for n, v in inputs.items()}
    ref = evaluate(front.program, ref_leaves)["O"]
    assert out.dtype == torch.float32 and out.shape == (B, H, NQ, D)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (out * dout.float()).sum().backward()
    (ref * dout).sum().backward()
    for name in ("Q", "K", "V", "table"):
        torch.testing.assert_close(leaves[name].grad.double(), ref_leaves[name].grad, rtol=1e-4, atol=1e-5)


def test_t5_spec_passes_ncd_check(cache):
    op = _load(T5_SPEC, cache)
    results = check_op(op, (torch.float32,), "cpu", seed=5)
    assert [c.label for c, _ in results] == ["streamed / normal", "streamed / large", "streamed / zeros",
                                             "decode / normal"]
    failures = [f"{case.label} {row}" for case, report in results for row in report if not row.ok]
    assert failures == []
    assert all("dtable" in {r.quantity for r in report} for _, report in results)


T5_LOG_INDEX = ("table[head, where(key > query, 16, 0) + where(abs(key - query) < 8, abs(key - query),\n"
                "    min(8 + floor(log(abs(key - query) / 8) / log(128 / 8) * (16 - 8)), 15))]")


def test_log_buckets_of_key_minus_query_run_in_the_attention_kernels_through_an_offset_table(run_cli, tmp_path,
                                                                                           cache):
    """T5's log buckets divide and take logarithms, which fp32 kernel arithmetic could round into another bucket
    than the float64 reference. As a function of key - query alone, the index becomes an int32 table over the
    offsets, built at call time by the reference's own float64 walk: the attention kernels read the entry the
    reference reads (every bucket of T5's, checked here over 562 offsets), and `ncd check` passes, table gradient
    included."""
    spec = tmp_path / "t5_log.ncd"
    spec.write_text(T5_SPEC.read_text().replace("axis rel = 33", "axis rel = 32").replace(
        "table[head, clamp(key - query, -16, 16) + 16]", T5_LOG_INDEX))
    code, out, _ = run_cli("compile", str(spec), "--emit", "plan")
    assert code == 0 and "kernel family: normalized-contraction attention" in out, out
    assert "index table: table at" in out and "declined by attention" not in out
    op = _load(spec, cache)
    offsets = torch.arange(1 - NQ_LOG, NK_LOG, dtype=torch.float64)
    table = op.module._offsets_0(offsets, torch.device("cpu"))
    assert table.dtype == torch.int32 and torch.equal(table.long(), _t5_buckets(offsets.long()))
    results = check_op(op, (torch.float32,), "cpu", seed=7)
    failures = [f"{case.label} {row}" for case, report in results for row in report if not row.ok]
    assert results and failures == []
    assert all("dtable" in {r.quantity for r in report} for _, report in results)


def test_the_shipped_t5_log_bucket_spec_passes_ncd_check_in_both_dtypes(cache):
    """Every case `ncd check` runs (large logits, exact zeros, decoding), fp32 and bf16, forward and every gradient,
    the table's included. (At scale 1 the large draw's scores pass 700, where the float64 reference's exp
    overflows: the spec keeps the usual 1 / sqrt(d) default.)"""
    op = _load(ROOT / "specs" / "t5_log_bucket_softmax.ncd", cache)
    results = check_op(op, (torch.float32, torch.bfloat16), "cpu", seed=11)
    failures = [f"{case.label} {row}" for case, report in results for row in report if not row.ok]
    assert len(results) == 5 and failures == []  # fp32: normal, large, zeros, decode; bf16: normal


def test_a_log_bucket_index_read_twice_shares_one_offset_table(run_cli, tmp_path, cache):
    """The table read twice at the same log index (a bias and its square): one offset table, one slot, and the op
    still matches the float64 reference, gradient included."""
    spec = tmp_path / "t5_log_twice.ncd"
    spec.write_text(T5_SPEC.read_text().replace("axis rel = 33", "axis rel = 32").replace(
        "table[head, clamp(key - query, -16, 16) + 16]",
        f"{T5_LOG_INDEX} + 0.5 * {T5_LOG_INDEX} * {T5_LOG_INDEX}"))
    code, out, _ = run_cli("compile", str(spec), "--emit", "plan")
    assert code == 0 and out.count("index table: table at") == 1, out
    op = _load(spec, cache)
    assert hasattr(op.module, "_offsets_0") and not hasattr(op.module, "_offsets_1")
    results = check_op(op, (torch.float32,), "cpu", seed=9, only=lambda case: case.label == "streamed / normal")
    assert results and all(row.ok for _, report in results for row in report)


def test_attention_family_declines_a_log_of_one_position_with_the_reason(run_cli, tmp_path):
    """A log of the query position alone is no function of key - query: the attention family declines it (the
    generic family computes it in float64)."""
    spec = tmp_path / "log_query.ncd"
    spec.write_text(T5_SPEC.read_text().replace("axis rel = 33", "axis rel = 32").replace(
        "table[head, clamp(key - query, -16, 16) + 16]", "table[head, min(floor(log(query + 1)), 31)]"))
    code, out, _ = run_cli("compile", str(spec), "--emit", "plan")
    assert code == 0 and out.startswith("family: generic"), out
    assert "declined by attention: log_query.ncd:18:54:" in out and "which the attention kernels print only " \
           "from positions, integers, + - *, min, max, clamp and abs (with a division or a log: of key - query " \
           "alone)" in out


NQ_LOG, NK_LOG = 300, 263  # distances to 299: every log bucket, and 64 (8 log(64 / 8) / log(16) = 6 exactly)
LOG_BUCKETS = f"""spec t5_log_buckets
axis head
axis query = {NQ_LOG}
axis key = {NK_LOG}
axis rel = 32
param table[head rel] : f32
# T5's bidirectional buckets (num_buckets 32, max_distance 128): 8 exact distances, then logarithmic up to 128
out bias[head query key] = table[head, where(key > query, 16, 0) + where(abs(key - query) < 8, abs(key - query),
    min(8 + floor(log(abs(key - query) / 8) / log(128 / 8) * (16 - 8)), 15))]
"""


def _t5_buckets(relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's `_relative_position_bucket` (bidirectional), as Hugging Face's transformers computes it."""
    num_buckets //= 2
    buckets = (relative > 0).to(torch.long) * num_buckets
    relative = torch.abs(relative)
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative, large)


def test_log_buckets_match_t5_in_the_reference_and_the_generic_family(tmp_path, cache):
    """floor(log(...)) takes a value within 1e-10 of an integer as that integer: in float64 the log form is
    5.999999999999999 at distance 64, where T5 (and the exact value) give bucket 6."""
    spec = tmp_path / "t5_log_buckets.ncd"
    spec.write_text(LOG_BUCKETS)
    op = _load(spec, cache)
    heads = 3
    table = torch.arange(heads * 32, dtype=torch.float64).reshape(heads, 32)
    i, j = torch.arange(NQ_LOG)[:, None], torch.arange(NK_LOG)[None, :]
    want = table[torch.arange(heads)[:, None, None], _t5_buckets(j - i)[None]]
    assert torch.equal(evaluate(op.front.program, {"table": table})["bias"], want)
    assert torch.equal(op(table.float()).double(), want)


def test_index_reads_an_integer_scalar_input(tmp_path, cache):
    spec = tmp_path / "shifted.ncd"
    spec.write_text("axis batch, pos\naxis slot = 16\nin x[batch slot] : f32\nin y[batch pos] : f32\n"
                    "in shift : i32 = 3\nout z[batch pos] = y * x[batch, clamp(pos + shift, 0, 15)]\n")
    op = _load(spec, cache)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(2, 16, generator=g), torch.randn(2, 21, generator=g)
    for shift in (3, -4):
        want = y * x[:, (torch.arange(21) + shift).clamp(0, 15)]
        ref = evaluate(op.front.program, {"x": x, "y": y, "shift": torch.tensor(shift)})["z"]
        torch.testing.assert_close(ref, want.double())
        torch.testing.assert_close(op(x, y, shift=shift), want)


def test_reference_names_tensor_axis_and_position_of_an_index_outside_its_axis():
    """The compiler proves indices in range, so only a hand-made IR can read outside: the reference raises."""
    front = front_end(T5_SPEC.read_text(), T5_SPEC.name)
    s = front.program.definition("S")
    load = next(n for n in ir.walk(s.value) if isinstance(n, ir.Load) and n.tensor == "table")
    unclamped = replace(load, index=(load.index[0], ir.LoadIndex(None, position("key") - position("query") + R)))

    def swap(node):
        if node is load:
            return unclamped
        if isinstance(node, ir.Binary):
            return replace(node, lhs=swap(node.lhs), rhs=swap(node.rhs))
        return node

    program = replace(front.program, definitions=(replace(s, value=swap(s.value)), *front.program.definitions[1:]))
    expected = r"table: index key - query \+ 16 of axis 'rel' \(size 33\) is 33 at query=0, key=17: outside the axis"
    with pytest.raises(IndexError, match=expected):
        evaluate(program, _inputs())


def test_floor_of_a_division_is_exact(tmp_path, cache):
    """floor((3 pos + 1) / 7) is computed as one division (never times a rounded 1/7), so it is exact."""
    spec = tmp_path / "strided.ncd"
    spec.write_text("axis pos = 100000\naxis slot = 42858\nin x[slot] : f32\n"
                    "out y[pos] = x[floor((3 * pos + 1) / 7)]\n")
    op = _load(spec, cache)
    x = torch.randn(42858, generator=torch.Generator().manual_seed(7))
    want = x[torch.div(3 * torch.arange(100000) + 1, 7, rounding_mode="floor")]
    assert torch.equal(evaluate(op.front.program, {"x": x})["y"], want.double())
    assert torch.equal(op(x), want)


def test_ncd_check_draws_an_integer_scalar_index_as_an_integer_constant(tmp_path, cache):
    """An i32 scalar without a default is drawn as an integer and takes no gradient (the generic family's
    constant inputs), so `ncd check` validates a spec whose index reads one."""
    spec = tmp_path / "shift_nodefault.ncd"
    spec.write_text("axis batch, pos\naxis slot = 16\nin x[batch slot] : f32\nin y[batch pos] : f32\nin shift : i32\n"
                    "out z[batch pos] = y * x[batch, clamp(pos + shift, 0, 15)]\n")
    op = _load(spec, cache)
    assert op.plan.constant_inputs() == frozenset({"shift"})
    results = check_op(op, (torch.float32,), "cpu", seed=8)
    assert [f"{case.label} {row}" for case, report in results for row in report if not row.ok] == []
    assert all({r.quantity for r in report} == {"z", "dx", "dy"} for _, report in results)
