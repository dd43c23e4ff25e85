"""How much the README's install command downloads: every wheel pip picks for ``pip install -c constraints.txt -e .``.

    python dev/install_size.py [OUT.json]          # default: docs/results/install_size.json

Runs ``pip install --isolated --dry-run --ignore-installed --report - -c constraints.txt -e .`` in this project
(``--isolated``: the public index only, none of this machine's pip configuration; ``--dry-run``: pip resolves from
the packages' metadata and installs nothing), then reads the size of each file pip would download from the index's
JSON simple API (PEP 691/700, the listing pip itself reads). OUT.json gets the date, the platform, the Python, the
pip command, per package name, version, file and bytes, and the total; ``dev/readme_blocks.py`` renders README's
``install`` block from it. With ``--extra-index-url URL`` (e.g. PyTorch's CPU index) the same for that variant
goes under ``variants[URL]``; a variant whose index cannot be reached is recorded as such.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def resolve(extra_index: str | None = None) -> list[dict]:
    """pip's report of what ``pip install -c constraints.txt -e .`` would install (the project itself left out):
    ``[{"name", "version", "url"}]``."""
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
           "--report", "-", "-c", "constraints.txt", "-e", "."]
    if extra_index:
        cmd[5:5] = ["--extra-index-url", extra_index, "--timeout", "20", "--retries", "1"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    return [{"name": item["metadata"]["name"], "version": item["metadata"]["version"],
             "url": item["download_info"]["url"]}
            for item in report["install"] if not item["download_info"]["url"].startswith("file:")]


def file_size(name: str, url: str) -> int:
    """Bytes of package ``name``'s file at ``url``: the ``size`` PyPI's JSON simple listing gives, else (another
    index) the ``Content-Length`` of a HEAD request."""
    filename = urllib.parse.unquote(url.rsplit("/", 1)[-1].split("#", 1)[0])
    if urllib.parse.urlparse(url).hostname == "files.pythonhosted.org":
        project = re.sub(r"[-_.]+", "-", name).lower()  # PEP 503's normalized name
        req = urllib.request.Request(f"https://pypi.org/simple/{project}/", headers={"Accept": SIMPLE_JSON})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        for f in files:
            if f["filename"] == filename and f.get("size") is not None:
                return int(f["size"])
        raise LookupError(f"{filename} not listed with a size on pypi.org/simple/{project}/")
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
        return int(r.headers["Content-Length"])


def measure(extra_index: str | None = None) -> dict:
    """The packages of one install with their file sizes, largest first, and the total."""
    resolved = resolve(extra_index)
    if extra_index:
        host = urllib.parse.urlparse(extra_index).hostname
        if not any(urllib.parse.urlparse(p["url"]).hostname == host for p in resolved):
            raise LookupError("pip took no package from this index: it was not reachable where this was measured")
    packages = []
    for p in resolved:
        size = file_size(p["name"], p["url"])
        packages.append({"name": p["name"], "version": p["version"], "file": p["url"].rsplit("/", 1)[-1],
                         "bytes": size})
    packages.sort(key=lambda p: (-p["bytes"], p["name"]))
    return {"packages": packages, "total_bytes": sum(p["bytes"] for p in packages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "docs" / "results" / "install_size.json")
    ap.add_argument("--extra-index-url", action="append", default=[],
                    help="also measure the install with this index added (e.g. PyTorch's CPU index)")
    args = ap.parse_args()
    doc = {
        "command": "python dev/install_size.py",
        "pip_command": "pip install --isolated --dry-run --ignore-installed --report - -c constraints.txt -e .",
        "date": dt.date.today().isoformat(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "pip": subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
        .stdout.split()[1],
        **measure(),
        "variants": {},
    }
    for url in args.extra_index_url:
        try:
            doc["variants"][url] = measure(url)
        except LookupError as e:
            doc["variants"][url] = {"error": str(e)}
        except (subprocess.CalledProcessError, OSError) as e:
            doc["variants"][url] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['packages'])} packages, {doc['total_bytes'] / 1e6:,.0f} MB -> {args.out}")


if __name__ == "__main__":
    main()
