"""The attention kernels bundle the spec's maps and flags into one constexpr, `Spec`, for their device functions: a
bundle built with its arguments out of order would swap hooks or flags silently (e.g. CAUSAL for HAS_WEIGHT)."""

import ast
import inspect

import pytest

from ncd.families.attention import kernel, kernel_chunked
from ncd.families.attention.kernel import FLAGS, HOOKS, MAPS, Spec


def _kernels():
    for module in (kernel, kernel_chunked):
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)  # a JITFunction's (or the interpreter's) Python function
            if "A1" in getattr(value, "arg_names", ()) and getattr(fn, "__module__", None) == module.__name__:
                yield name, value


KERNELS = dict(_kernels())
assert len(KERNELS) >= 10, sorted(KERNELS)  # the streamed and factorized kernels that take the maps


def test_the_bundle_has_the_fields_the_host_passes():
    assert Spec._fields == MAPS + HOOKS + FLAGS


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_kernel_takes_the_maps_and_flags_in_order_and_bundles_them_by_name(name):
    jit = KERNELS[name]
    start = jit.arg_names.index("A1")
    assert tuple(jit.arg_names[start:start + len(Spec._fields)]) == Spec._fields
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(jit.fn)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Spec"]
    for call in calls:  # positional, one argument per field, each the kernel's argument of that name
        assert not call.keywords
        assert [arg.id for arg in call.args if isinstance(arg, ast.Name)] == list(Spec._fields)


def test_the_kernels_that_evaluate_maps_in_device_functions_bundle_them():
    bundling = {name for name, jit in KERNELS.items() if "Spec(" in inspect.getsource(jit.fn)}
    assert {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "bwd_fused_kernel", "fact_fwd_kernel", "fact_dq_kernel",
            "fact_dkdv_kernel"} <= bundling
