// Swagger UI from packaged files; the OpenAPI document declares the bearer scheme ("Authorize").
window.addEventListener("load", () => {
  window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui", validatorUrl: null, deepLinking: true});
});
