"""Report rendering: Markdown by markdown-it-py, a table of contents that matches the sections, SVG figures
(PNG at 2x when heavy), curated headline tables, and a smoother that follows a curved cloud."""

import re

import numpy as np
import pytest

from reprlab.report import Section, render, table_markdown
from reprlab.report.figures import lowess, pyplot
from reprlab.report.headline import Headline, run_headline, sweep_headline


def test_table_markdown_formats_numbers():
    md = table_markdown([{"model": "a", "acc": 0.912345}, {"model": "b", "acc": 1e-7, "extra": 3}])
    assert "| model | acc | extra |" in md and "0.9123" in md and "1.000e-07" in md
    assert "|---|---:|---:|" in md  # numbers right-aligned, text left-aligned


def test_table_markdown_keeps_one_row_per_line_and_every_cell_in_its_column():
    """Generated text holds line breaks and pipes, and column names hold pipes ("rho | count"): escaped, each
    row of the markdown table has as many cells as its header (GitHub drops a table whose rows disagree)."""
    rows = [
        {"rho | count": 0.5, "continuation": "**:\n\nImmediate Action: a | b", "x": "ok"},
        {"x": "y|z\rw"},
    ]
    lines = table_markdown(rows).splitlines()
    assert len(lines) == 2 + len(rows)

    def cells(line: str) -> int:
        return len(re.split(r"(?<!\\)\|", line)) - 2

    assert {cells(x) for x in lines} == {3}
    assert "Immediate Action: a \\| b" in lines[2] and "**:<br><br>Immediate" in lines[2]


def test_render_embeds_svg_figures_and_renders_markdown(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    text = "**bold** text\n\n- first\n- second\n\n```\nseed: 0\n```"
    html, md = render([Section("Curve", text=text, figure=fig, table=[{"k": 1}])], "T", tmp_path)
    page = html.read_text()
    assert "data:image/svg+xml;base64," in page and "<strong>bold</strong>" in page
    assert "<li>first</li>" in page and "- first" not in page  # a real list, not raw bullet lines
    assert "<pre><code>seed: 0\n</code></pre>" in page and "```" not in page
    assert (tmp_path / "figures" / "curve.svg").read_text().lstrip().startswith("<?xml")
    assert "figures/curve.svg" in md.read_text()


def test_heavy_figures_fall_back_to_png_at_twice_the_resolution(tmp_path, monkeypatch):
    import reprlab.report.figures as figures

    monkeypatch.setattr(figures, "MAX_SVG_BYTES", 100)  # any SVG is "heavy"
    plt = pyplot()
    fig, _ = plt.subplots(figsize=(4, 3))
    render([Section("Dense", figure=fig)], "T", tmp_path)
    from PIL import Image

    with Image.open(tmp_path / "figures" / "dense.png") as im:
        assert (
            im.size[0] >= 2 * 4 * 100 * 0.9
        )  # 200 dpi (2x of 100-dpi layout); bbox tightening trims a little


def test_toc_links_every_section_and_collapsed_sections_start_closed(tmp_path):
    secs = [Section("Claims and headline results", anchor="claims"),
            Section("Method", children=[Section("Part A"), Section("Part A")]),
            Section("Config", text="x", collapsed=True)]  # fmt: skip
    html, md = render(secs, "T", tmp_path)
    page = html.read_text()
    ids = re.findall(r'<section id="([^"]+)"', page)
    links = re.findall(r'<nav id="toc".*?</nav>', page, re.S)[0]
    assert ids == ["claims", "method", "part-a", "part-a-2", "config"]  # unique anchors, in page order
    assert re.findall(r'href="#([^"]+)"', links) == ids
    assert re.search(r'id="config" class="lvl2"><details>', page) and re.search(
        r'id="claims" class="lvl2"><details open>', page
    )
    assert page.index("<h1") < page.index('id="claims"') < page.index('id="method"')
    toc = md.read_text()  # GitHub's heading anchors: lower case, punctuation dropped, repeats numbered
    assert (
        "- [Claims and headline results](#claims-and-headline-results)" in toc
        and "- [Part A](#part-a-1)" in toc
    )


def test_wide_tables_scroll_inside_their_box(tmp_path):
    html, _ = render([Section("Wide", table=[{f"column {i}": "x" * 40 for i in range(30)}])], "T", tmp_path)
    page = html.read_text()
    assert '<div class="scroll"><table>' in page and ".scroll{overflow-x:auto" in page


def test_lowess_follows_a_saturating_curve_where_a_straight_line_cannot():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 6, 800)
    truth = lambda t: 1 - np.exp(-t)  # noqa: E731
    y = truth(x) + rng.normal(0, 0.05, x.size)
    grid, curve = lowess(x, y, frac=0.2)
    err = np.abs(curve - truth(grid))
    slope, icept = np.polyfit(x, y, 1)
    ols_err = np.abs(icept + slope * grid - truth(grid))
    # noise sd 0.05 over ~160 points per local fit: a local line is within ~0.03 except at the sharp bend;
    # the straight line misses the bend by > 0.2
    assert np.median(err) < 0.02 and err.max() < 0.1 and ols_err.max() > 0.2


def test_lowess_is_exact_on_a_straight_line():
    x = np.linspace(0, 1, 50)
    grid, curve = lowess(x, 3 * x - 1)
    np.testing.assert_allclose(curve, 3 * grid - 1, atol=1e-12)  # weighted least squares of exact points


def test_headline_table_lays_out_cells_and_drops_empty_rows_and_columns():
    h = Headline(rows=(("none", "none"), ("OTCCLIP", "otcclip"), ("absent", "x")),
                 cols=(("ASR", "asr"), ("acc", "acc"), ("gone", "nothing")), pattern="{row}.{col}",
                 corner="defense", labels={"asr": {-1.0: "coded"}})  # fmt: skip
    summary = {"none.asr": 0.62, "otcclip.asr": -1.0, "none.acc": 0.4, "none.acc_lo": 0.35, "none.acc_hi": 0.45,
               "otcclip.acc": None, "otcclip.acc.null_reason": "constant input"}  # fmt: skip
    rows = run_headline(h, summary)
    assert rows == [{"defense": "none", "ASR": "0.62", "acc": "0.400 [0.350, 0.450]"},
                    {"defense": "OTCCLIP", "ASR": "coded", "acc": "n/a (constant input)"}]  # fmt: skip
    detail = {
        "none.asr": {"mean": 0.5, "ci_lo": 0.4, "ci_hi": 0.6},
        "otcclip.asr": {"mean": 0.1, "ci_lo": None},
    }
    assert sweep_headline(h, detail) == [{"defense": "none", "ASR": "0.50 [0.40, 0.60]"},
                                         {"defense": "OTCCLIP", "ASR": "0.1 (1 seed)"}]  # fmt: skip


def test_a_coded_column_over_seeds_counts_its_labels_instead_of_averaging_codes():
    """A verdict of +1/0/−1 averaged over seeds (0.5 [−5.9, 6.9]) is no verdict: a sweep shows how many seeds
    gave each label, in the headline and for every key whose last part is the coded column."""
    from reprlab.report.headline import coded_counts, coded_keys

    labels = {1: "survives (+)", -1: "survives (−)", 0: "explained by a null"}
    h = Headline(rows=(("sum", "m.sum"), ("ind", "m.ind")), cols=(("rho", "spearman"), ("nulls", "verdict")),
                 pattern="{row}.{col}", labels={"verdict": labels})  # fmt: skip
    detail = {
        "m.sum.spearman": {"mean": 0.4, "ci_lo": 0.3, "ci_hi": 0.5, "per_seed": {"0": 0.35, "1": 0.45}},
        "m.sum.verdict": {"mean": 0.5, "ci_lo": -5.9, "ci_hi": 6.9, "per_seed": {"0": 1.0, "1": 0}},
        "m.ind.verdict": {"mean": -1.0, "ci_lo": -1.0, "ci_hi": -1.0, "per_seed": {"0": -1, "1": -1.0}},
    }
    rows = sweep_headline(h, detail)
    assert rows[0]["nulls"] in ("survives (+) on 1, explained by a null on 1 of 2 seeds",
                                "explained by a null on 1, survives (+) on 1 of 2 seeds")  # fmt: skip
    assert rows[1]["nulls"] == "survives (−) on 2 of 2 seeds"
    assert rows[0]["rho"] == "0.40 [0.30, 0.50]"  # other columns keep the mean and interval
    keys = coded_keys([h], ["m.sum.verdict", "other.first@whiten.verdict", "m.sum.spearman"])
    assert set(keys) == {"m.sum.verdict", "other.first@whiten.verdict"}
    assert coded_counts(labels, {"0": 0.5}) is None  # a value outside the codes: not a coded key after all


def test_a_sweeps_wall_time_is_its_mean_and_range_never_a_negative_interval():
    from reprlab.report.sweep import _wall_time_text

    two = {"mean": 1.5, "ci_lo": -12.0, "ci_hi": 15.0, "per_seed": {"0": 0.5, "1": 2.5}}
    text = _wall_time_text(two)
    assert "-12" not in text and "2 s per seed on the mean, 0–2 s over 2 seeds" in text
    assert _wall_time_text({"mean": 48.8, "per_seed": {"0": 48.8}}) == "49 s (1 seed)."


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_cells_read_n_a(value):
    assert "| n/a |" in table_markdown([{"x": value}])
