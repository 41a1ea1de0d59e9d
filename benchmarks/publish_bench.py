"""Turn one `kvsqueeze bench` report folder into BENCHMARKS.md at the repository root.

    python benchmarks/publish_bench.py bench/20261121-172644

The report is copied as written by the bench (its command, date, machine, threads and protocols are in its
header); only the image links are rewritten to point at copies of the plots under benchmarks/figures/.
Nothing is measured or edited by hand here: every number comes from the bench run.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def publish(folder: Path, out: Path, figures: Path) -> Path:
    report = folder / "report.md"
    if not report.is_file():
        raise SystemExit(f"{folder} is not a bench report folder (no report.md)")
    figures.mkdir(parents=True, exist_ok=True)
    for png in folder.glob("*.png"):
        shutil.copy2(png, figures / png.name)
    rel = figures.relative_to(out.parent) if figures.is_relative_to(out.parent) else figures
    text = re.sub(r"\]\(([\w.-]+\.png)\)", lambda m: f"]({rel.as_posix()}/{m[1]})", report.read_text())
    out.write_text(text, encoding="utf-8")
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
