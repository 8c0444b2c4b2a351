"""benchmarks/results_file: each script's section between its own markers, a machine's run kept beside another's."""

from __future__ import annotations


def test_a_suffixed_section_is_written_beside_the_first_and_replaced_in_place(tmp_path):
    from benchmarks.results_file import suffixed, write_section

    start, end = "<!-- kernels:start -->", "<!-- kernels:end -->"
    assert suffixed(start, end, "") == (start, end, "")
    s2, e2, title = suffixed(start, end, "epyc")
    assert (s2, e2, title) == ("<!-- kernels-epyc:start -->", "<!-- kernels-epyc:end -->", " (epyc)")
    path = tmp_path / "RESULTS.md"
    write_section(path, start, end, f"{start}\nxeon 1\n{end}")
    write_section(path, s2, e2, f"{s2}\nepyc 1\n{e2}")
    write_section(path, s2, e2, f"{s2}\nepyc 2\n{e2}")  # the same machine again: replaced, the other kept
    text = path.read_text()
    assert "xeon 1" in text and "epyc 2" in text and "epyc 1" not in text
    assert text.index("xeon 1") < text.index("epyc 2") and text.count(s2) == 1


def test_a_cell_is_the_median_and_range_of_the_rounds_or_one_rounds_value():
    from benchmarks.results_file import median_cell

    assert median_cell([2.0, 1.0, 4.0], 1) == "2.0 (1.0–4.0)"
    assert median_cell([3.14159], 2) == "3.14"
