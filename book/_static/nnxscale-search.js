// Search snippets from the chapter text alone: not the page's header, buttons, outline or
// footer, not the hidden setup cell, and math as its symbols rather than raw LaTeX.
(() => {
  const patch = () => {
    if (typeof Search === "undefined" || Search.nnxscalePatched) return;
    Search.nnxscalePatched = true;
    Search.htmlToText = (htmlString, anchor) => {
      const page = new DOMParser().parseFromString(htmlString, "text/html");
      const drop = ".headerlink, script, style, .tag_hide-cell, .tag_remove-cell, .cell_output";
      page.querySelectorAll(drop).forEach((e) => e.remove());
      page.querySelectorAll(".math").forEach((e) => {
        e.textContent = e.textContent
          .replace(/\\[()[\]]|\$\$/g, "")
          .replace(/\\frac\{([^{}]*)\}\{([^{}]*)\}/g, "($1)/($2)")
          .replace(/\\(?:mathrm|text|operatorname)\{([^}]*)\}/g, "$1")
          .replace(/\\(?:left|right|,|;|!|quad)/g, "")
          .replace(/\\cdot|\\times/g, "×")
          .replace(/\\[a-zA-Z]+/g, "")
          .replace(/[{}]/g, "");
      });
      const article = page.querySelector("article.bd-article") || page.querySelector('[role="main"]');
      if (!article) return "";
      const block = anchor ? article.querySelector(anchor) : null;
      return (block || article).textContent.replace(/\s+/g, " ");
    };
  };
  patch();
  document.addEventListener("DOMContentLoaded", patch);
})();
