from reprlab.report import Section, render, table_markdown


def test_table_markdown_formats_numbers():
    md = table_markdown([{"model": "a", "acc": 0.912345}, {"model": "b", "acc": 1e-7, "extra": 3}])
    assert "| model | acc | extra |" in md and "0.9123" in md and "1.000e-07" in md


def test_render_embeds_figures_and_writes_pngs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    html, md = render([Section("Curve", text="**bold** text", figure=fig, table=[{"k": 1}])], "T", tmp_path)
    page = html.read_text()
    assert "data:image/png;base64," in page and "<strong>bold</strong>" in page
    assert (tmp_path / "figures" / "curve.png").exists() and "figures/curve.png" in md.read_text()


def test_fenced_blocks_render_as_pre(tmp_path):
    html, _ = render([Section("Config", text="before\n```\nseed: 0\n```\nafter")], "T", tmp_path)
    page = html.read_text()
    assert "<pre>seed: 0\n</pre>" in page and "<p>before</p>" in page and "```" not in page
