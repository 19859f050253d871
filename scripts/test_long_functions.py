"""Tests for scripts/long-functions.py, on small fake crates made in tmp_path."""
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("long_functions", HERE / "long-functions.py")
lf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lf)


def crate(tmp_path, files):
    """Write {relative path: source} under tmp_path/src and return that dir."""
    src = tmp_path / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


def body(lines):
    """A function of exactly `lines` lines, signature and closing brace included."""
    return "fn long() {\n" + "    let x = 1;\n" * (lines - 2) + "}\n"


def run(capsys, src, *extra):
    rc = lf.main([*extra, str(src)])
    return rc, capsys.readouterr().out


def test_a_function_over_the_limit_fails_and_is_named(tmp_path, capsys):
    src = crate(tmp_path, {"lib.rs": body(6)})
    rc, out = run(capsys, src, "--max", "5")
    assert rc == 1
    assert "6 lines  long" in out and "lib.rs:1" in out


def test_a_function_at_the_limit_passes(tmp_path, capsys):
    src = crate(tmp_path, {"lib.rs": body(5)})
    rc, out = run(capsys, src, "--max", "5")
    assert rc == 0, out


def test_tests_are_not_counted(tmp_path, capsys):
    long_test = "#[test]\n" + body(9)
    src = crate(tmp_path, {
        "lib.rs": "#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline {\n" + body(9) + "}\n" + long_test,
        "tests.rs": body(9),
        "tests/it.rs": body(9),
    })
    rc, out = run(capsys, src, "--max", "5")
    assert rc == 0, out


def test_braces_in_strings_and_comments_do_not_end_a_function(tmp_path, capsys):
    text = 'fn tricky() {\n    let s = "}";\n    // }\n    let c = \'}\';\n    /* } */\n    let y = 2;\n}\n'
    src = crate(tmp_path, {"lib.rs": text})
    rc, out = run(capsys, src, "--max", "6")
    assert rc == 1 and "7 lines  tricky" in out


def test_a_declaration_without_a_body_is_skipped(tmp_path, capsys):
    src = crate(tmp_path, {"lib.rs": "trait T {\n    fn f(&self);\n}\nstruct S;\nimpl S {\n    fn g() {}\n}\n"})
    rc, out = run(capsys, src, "--max", "1")
    assert rc == 0, out
