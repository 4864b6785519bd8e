/* Tap a figure to see it large: an overlay served by the site itself (no external assets).
   On a phone the figure opens at its own width or the screen's, whichever is larger, and
   scrolls in both directions; a tap on the background, the close button or Escape ends it.
   Every figure of a page is marked data-zoom="1" (the site check looks for the mark). */
(function () {
  "use strict";

  function close(overlay) {
    overlay.remove();
    document.documentElement.classList.remove("cfs-lightbox-open");
  }

  function open(img) {
    const overlay = document.createElement("div");
    overlay.className = "cfs-lightbox";
    overlay.setAttribute("role", "dialog");
    overlay.setAttribute("aria-label", img.alt || "figure");
    const button = document.createElement("button");
    button.className = "cfs-lightbox__close";
    button.type = "button";
    button.setAttribute("aria-label", "Close");
    button.textContent = "×";
    const frame = document.createElement("div");
    frame.className = "cfs-lightbox__frame";
    const large = document.createElement("img");
    large.src = img.currentSrc || img.src;
    large.alt = img.alt;
    const natural = img.naturalWidth || img.clientWidth;
    large.style.width = Math.max(natural, Math.min(window.innerWidth * 2, 2 * img.clientWidth)) + "px";
    frame.appendChild(large);
    overlay.append(button, frame);
    overlay.addEventListener("click", (e) => {
      if (e.target === overlay || e.target === frame || e.target === button) close(overlay);
    });
    document.addEventListener("keydown", function onKey(e) {
      if (e.key === "Escape") {
        close(overlay);
        document.removeEventListener("keydown", onKey);
      }
    });
    document.body.appendChild(overlay);
    document.documentElement.classList.add("cfs-lightbox-open");
    button.focus();
  }

  function mark(root) {
    for (const img of root.querySelectorAll("article img")) {
      if (img.dataset.zoom === "1" || img.closest("a")) {
        if (img.closest("a")) img.dataset.zoom = "1";   // a linked image opens its link instead
        continue;
      }
      img.dataset.zoom = "1";
      img.tabIndex = 0;
      img.addEventListener("click", () => open(img));
      img.addEventListener("keydown", (e) => { if (e.key === "Enter") open(img); });
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", () => mark(document));
  } else {
    mark(document);
  }
})();
