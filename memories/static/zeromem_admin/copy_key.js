// The "Copy" button of the new-API-key page (a file, not an inline handler: the admin's
// Content-Security-Policy allows scripts from this origin only).
(function () {
  var field = document.getElementById("new-api-key");
  var button = document.getElementById("copy-api-key");
  if (!field || !button) return;
  field.addEventListener("click", function () { field.select(); });
  button.addEventListener("click", function () {
    field.select();
    var done = function () { button.textContent = "Copied"; };
    var fallback = function () { document.execCommand("copy"); done(); };
    (navigator.clipboard ? navigator.clipboard.writeText(field.value) : Promise.reject()).then(done, fallback);
  });
})();
