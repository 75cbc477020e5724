// ESLint for the peers' JavaScript (make lint-scripts runs it from benches/peers, so that it sees
// summary.mjs beside this directory): the recommended rules, Node's globals.
import js from "@eslint/js";
import globals from "globals";

export default [
  js.configs.recommended,
  {
    files: ["**/*.mjs"],
    languageOptions: { ecmaVersion: "latest", sourceType: "module", globals: globals.node },
  },
];
