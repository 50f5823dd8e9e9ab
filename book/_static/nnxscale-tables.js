// A table wider than the page scrolls sideways inside its box; on a narrow screen nothing
// else says so. Above each such table, a line that does, kept up to date as the page resizes.
(() => {
  const mark = () => {
    document.querySelectorAll(".pst-scrollable-table-container").forEach((box) => {
      const scrolls = box.scrollWidth > box.clientWidth + 1;
      let hint = box.previousElementSibling;
      if (!(hint && hint.classList.contains("nnxscale-scroll-hint"))) {
        hint = document.createElement("p");
        hint.className = "nnxscale-scroll-hint";
        hint.textContent = "This table is wider than the page: scroll it sideways →";
        box.before(hint);
      }
      hint.hidden = !scrolls;
      box.classList.toggle("nnxscale-scrolls", scrolls);
    });
  };
  document.addEventListener("DOMContentLoaded", mark);
  window.addEventListener("resize", mark);
})();
