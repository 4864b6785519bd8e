"""mkdocs hook: a download link on every notebook page.

mkdocs-jupyter (``include_source: true``) copies each notebook beside its page; this puts
a link to that copy at the top of the page, so a reader can take the lab home.
"""

from __future__ import annotations

import html
import posixpath


def on_page_content(content: str, page, config, files) -> str:
    src = page.file.src_uri
    if not src.endswith(".ipynb"):
        return content
    name = posixpath.basename(src)
    link = (f'<p class="nb-download"><a href="{html.escape(name)}" download>'
            f"Download {html.escape(name)}</a> and run it with Jupyter from the "
            "<code>notebooks/</code> folder of your checkout.</p>\n")
    return link + content
