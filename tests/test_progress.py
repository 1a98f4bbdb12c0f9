"""Progress bars: shown on a terminal or when forced, a do-nothing bar otherwise."""

from lightspan.core import progress as p


def test_forced_on_the_bar_renders_its_count_and_status(monkeypatch, capsys):
    monkeypatch.setenv("LIGHTSPAN_PROGRESS", "1")
    with p.progress("rollouts (train)", total=4) as bar:
        bar.advance(3)
        bar.update("ok 3")
    err = capsys.readouterr().err
    assert "rollouts (train)" in err and "3/4" in err and "ok 3" in err


def test_off_or_not_a_terminal_nothing_is_written(monkeypatch, capsys):
    monkeypatch.setenv("LIGHTSPAN_PROGRESS", "0")
    with p.progress("training", unit="steps") as bar:
        bar.advance()
        bar.update("version 1")
    monkeypatch.delenv("LIGHTSPAN_PROGRESS")        # pytest's captured stderr is not a TTY
    with p.progress("training") as bar:
        bar.advance()
    monkeypatch.setenv("LIGHTSPAN_PROGRESS", "1")
    with p.progress("other ranks", show=False) as bar:
        bar.advance()
    assert capsys.readouterr().err == ""
