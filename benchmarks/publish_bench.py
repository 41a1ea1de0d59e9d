"""Put one `kvsqueeze bench` report folder into BENCHMARKS.md, as the section between the bench-report markers.

    python benchmarks/publish_bench.py bench/20261121-172644

The report is copied as written by the bench (its command, date, machine, threads and protocols are in its
header); only its headings are moved two levels down (it sits under a "## 7." heading kept outside the
markers) and its image links are rewritten to point at copies of the plots under benchmarks/figures/.  The rest of BENCHMARKS.md is left as it is; without the
markers the section is appended with them.  Nothing is measured or edited by hand here: every number comes from
the bench run.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench-report:start -->", "<!-- bench-report:end -->"


def section(folder: Path, out: Path, figures: Path) -> str:
    report = folder / "report.md"
    if not report.is_file():
        raise SystemExit(f"{folder} is not a bench report folder (no report.md)")
    figures.mkdir(parents=True, exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copy2(png, figures / png.name)
    rel = figures.relative_to(out.parent) if figures.is_relative_to(out.parent) else figures
    text = re.sub(r"\]\(([\w.-]+\.png)\)", lambda m: f"]({rel.as_posix()}/{m[1]})", report.read_text())
    return re.sub(r"^(#+) ", lambda m: f"{m[1]}## ", text, flags=re.MULTILINE).strip()


def publish(folder: Path, out: Path, figures: Path) -> Path:
    body = f"{START}\n{section(folder, out, figures)}\n{END}"
    old = out.read_text(encoding="utf-8") if out.is_file() else "# Benchmarks\n"
    if START in old and END in old:
        head, rest = old.split(START, 1)
        new = head + body + rest.split(END, 1)[1]
    else:
        new = old.rstrip() + "\n\n" + body + "\n"
    out.write_text(new, encoding="utf-8")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a bench/<timestamp> folder")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--figures", type=Path, default=ROOT / "benchmarks" / "figures")
    args = ap.parse_args()
    print(f"wrote {publish(args.folder, args.out.resolve(), args.figures.resolve())}")


if __name__ == "__main__":
    main()
