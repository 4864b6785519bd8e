"""Screenshots of the built site at reading widths, to look at before a change lands.

    .venv/bin/python -m mkdocs build -d site
    .venv/bin/python tools/screenshots.py --site site --out build/screens            # lessons, labs, benchmarks
    .venv/bin/python tools/screenshots.py --site site --out build/screens lessons/04-ring/

Each page is opened in headless Chromium (offline, like tools/check_site.py) at 1400 px
and 400 px wide; a full-page PNG is written per page and width, cut into pieces of at most
``--height`` pixels so that an image viewer shows them at a readable scale.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
check_site = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_site", check_site)
_spec.loader.exec_module(check_site)


def default_paths() -> list[str]:
    paths = []
    for item in check_site.LESSONS:
        paths += [f"lessons/{item.page.stem}/", f"notebooks/{item.notebook.stem}/"]
    return paths + ["benchmarks/"]


async def _shoot(base, paths, widths, out: Path, chromium, height, dark):
    from playwright.async_api import async_playwright

    out.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=check_site.CHROMIUM_FLAGS)
        for width in widths:
            context = await browser.new_context(viewport={"width": width, "height": 900},
                                                color_scheme="dark" if dark else "light")
            await context.route("**/*", lambda route: route.continue_()
                                if route.request.url.startswith(base) else route.abort())
            page = await context.new_page()
            for path in paths:
                await page.goto(base + path, wait_until="load")
                await page.wait_for_timeout(400)
                total = await page.evaluate("document.documentElement.scrollHeight")
                stem = path.strip("/").replace("/", "_") or "home"
                for i, top in enumerate(range(0, total, height)):
                    clip = {"x": 0, "y": top, "width": width, "height": min(height, total - top)}
                    name = out / f"{stem}-{width}{'-dark' if dark else ''}-{i:02d}.png"
                    await page.screenshot(path=str(name), clip=clip, full_page=True)
                print(f"{path} at {width} px: {total} px high")
            await context.close()
        await browser.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="URL paths (default: every lesson, lab, benchmarks)")
    parser.add_argument("--site", type=Path, default=ROOT / "site")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "screens")
    parser.add_argument("--widths", default="1400,400")
    parser.add_argument("--height", type=int, default=2400, help="pixels per piece")
    parser.add_argument("--dark", action="store_true", help="the dark scheme")
    args = parser.parse_args(argv)
    chromium = check_site.find_chromium()
    widths = [int(w) for w in args.widths.split(",")]
    with check_site.serve(args.site) as base:
        asyncio.run(_shoot(base, args.paths or default_paths(), widths, args.out, chromium,
                           args.height, args.dark))
    return 0


if __name__ == "__main__":
    sys.exit(main())
