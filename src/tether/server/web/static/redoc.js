// ReDoc from packaged files.
window.addEventListener("load", () => { Redoc.init("/openapi.json", {}, document.getElementById("ui")); });
