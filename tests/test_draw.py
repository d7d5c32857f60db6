"""`ncd draw` (ncd/drawing): every shipped spec's diagram parses as SVG and names each of its tensors and axes; the
committed gallery (docs/gallery) is what the code draws now; a PNG is non-blank and matches a golden picture;
the plan stage marks the family, the streamed axis with its state, and the kernel; a malformed spec gives the
located error and writes nothing; `ncd check --draw` prints where the diagram went."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ncd.cli import main
from ncd.drawing import draw_spec
from ncd.drawing.gallery import SPECS, gallery
from ncd.drawing.render import to_png, to_svg
from ncd.pipeline import front_end, load_spec

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "draw" / "causal_softmax_attention.png"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def drawn() -> dict[str, bytes]:
    return gallery()


def _texts(svg: bytes) -> str:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return "\n".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))


def test_every_shipped_diagram_names_its_tensors_and_axes(drawn):
    for spec in sorted(SPECS.glob("*.ncd")):
        program = load_spec(spec).program
        texts = _texts(drawn[f"{spec.stem}.svg"])
        for name in [t.name for t in program.tensors] + [a.name for a in program.axes]:
            assert name in texts, f"{spec.name}: the diagram does not name {name}"
        assert "compiled by the" in texts and "kernel: " in texts


def test_the_committed_gallery_is_up_to_date(drawn):
    committed = ROOT / "docs" / "gallery"
    stale = [name for name, data in drawn.items()
             if not (committed / name).exists() or (committed / name).read_bytes() != data]
    extra = sorted({p.name for p in committed.iterdir()} - set(drawn))
    assert not stale and not extra, (f"docs/gallery is stale ({stale}) or holds files no spec draws ({extra}): run "
                                     "`python -m ncd.drawing.gallery`")


def test_the_plan_stage_marks_family_stream_state_and_kernel():
    attention = load_spec(SPECS / "causal_softmax_attention.ncd")
    plan, ir_only = _texts(draw_spec(attention, "plan")), _texts(draw_spec(attention, "ir"))
    for mark in ("compiled by the attention family", "streamed over key", "state: m, o, z",
                 "kernel: attention: one fused op"):
        assert mark in plan and mark not in ir_only
    for shared in ("normalize over key", "a1(x) = exp(x)", "contract over dim", "woven: batch head",
                   "broadcast over query", "mask [key query]"):
        assert shared in plan and shared in ir_only
    gka = _texts(draw_spec(load_spec(SPECS / "gka.ncd"), "plan"))
    assert "scan over time" in gka and "streamed over time" in gka and "chebyshev_solve" in gka
    generic = _texts(draw_spec(load_spec(SPECS / "swiglu_mlp.ncd"), "plan"))
    assert "compiled by the generic family" in generic and "kernel: generic: torch ops for" in generic
    kan = _texts(draw_spec(load_spec(SPECS / "cheby_kan.ncd"), "plan"))
    assert "basis T[deg](x)" in kan and "T[n+1](u) = 2 * u * T[n] - T[n-1]" in kan and "param" in kan


def _pixels(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def test_the_png_is_non_blank_and_matches_the_golden_picture():
    """The shapes alone (no system fonts: the text would differ from machine to machine), against the committed
    picture: at most 0.02% of the pixels (anti-aliasing) differ by more than 5 levels in the mean of their channels."""
    front = load_spec(SPECS / "causal_softmax_attention.ncd")
    svg = draw_spec(front, "plan").decode("utf-8")
    got = _pixels(to_png(svg, fonts=False))
    colours = got.getcolors(maxcolors=1 << 20) or []
    inked = sum(n for n, c in colours if c != (255, 255, 255))
    assert inked > 0.02 * got.width * got.height  # boxes, wires, fills: not a blank page
    want = _pixels(GOLDEN.read_bytes())
    assert got.size == want.size
    from PIL import ImageChops

    worst = ImageChops.difference(got, want).convert("L", (1 / 3, 1 / 3, 1 / 3, 0)).point(lambda v: v > 5 and 255)
    differ = worst.histogram()[255]  # pixels whose mean channel differs by more than 5 (16 in one channel, about)
    assert differ <= 0.0002 * got.width * got.height, f"{differ} pixels differ from {GOLDEN.name}"
    with_text = _pixels(to_png(svg))
    assert with_text.size == got.size


def test_draw_writes_svg_and_png_and_a_malformed_spec_writes_nothing(tmp_path, capsys):
    spec = SPECS / "cheby_kan.ncd"
    assert main(["draw", str(spec), "-o", str(tmp_path / "kan.svg")]) == 0
    ET.fromstring((tmp_path / "kan.svg").read_bytes())
    assert main(["draw", str(spec), "--stage", "ir", "-o", str(tmp_path / "kan.png")]) == 0
    assert (tmp_path / "kan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.split() == [str(tmp_path / "kan.svg"), str(tmp_path / "kan.png")]
    bad = tmp_path / "bad.ncd"
    bad.write_text("spec bad\naxis a\nin X[a] : f32\nout Y[a] = X + Z\n")
    assert main(["draw", str(bad), "-o", str(tmp_path / "bad.svg")]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:4:16: error[unknown-name]: unknown name 'Z'" in err and "^" in err
    assert not (tmp_path / "bad.svg").exists()
    assert main(["draw", str(spec), "-o", str(tmp_path / "kan.pdf")]) == 2
    assert "--format is svg or png" in capsys.readouterr().err and not (tmp_path / "kan.pdf").exists()


def test_check_draw_prints_the_diagram_path(tmp_path, capsys):
    out = tmp_path / "gelu.svg"
    assert main(["check", str(SPECS / "gelu.ncd"), "--seed", "1", "--draw", str(out)]) == 0
    assert f"diagram    {out}" in capsys.readouterr().out
    assert "gelu" in _texts(out.read_bytes())


def test_an_empty_diagram_still_draws():
    """A spec whose output is an input read again: one wire, two boxes."""
    front = front_end("spec copy\naxis a\nin X[a] : f32\nout Y[a] = X\n", "copy.ncd")
    from ncd.drawing import diagram

    graph = diagram(front.program)
    assert sorted(graph.nodes) == ["tensor:X", "tensor:Y"] and graph.has_edge("tensor:X", "tensor:Y")
    assert "copy" in _texts(to_svg(graph, "spec copy").encode())
