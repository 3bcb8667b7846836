// Render the formulas pymdownx.arithmatex (generic mode) leaves as \( \) and \[ \] in
// spans and divs of class "arithmatex", with the KaTeX bundled beside this file.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    ignoredClasses: ["highlight", "md-code"],
  });
});
