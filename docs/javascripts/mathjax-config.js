// MathJax 3 for pymdownx.arithmatex (generic mode): typeset \( \) and \[ \] only inside
// the spans and divs arithmatex marks, so that dollar signs in code stay text.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
  svg: { fontCache: "global" },
};
