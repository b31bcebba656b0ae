// The Jinja engine against jinja2 and transformers: the public chat templates of popular model
// families rendered over a fixture of conversations must be byte-identical to transformers'
// apply_chat_template (fixtures/conversations.json), and small templates pinning down each piece
// of semantics must match jinja2 (fixtures/snippets.json); both files are written by
// fixtures/make_fixtures.py. Then the errors: origin, line and column for syntax and runtime
// errors, and hostile templates refused, never a crash.
#include "template/template.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>

using ft::jinja::RenderOptions;
using ft::jinja::Template;
using ft::jinja::TemplateError;
using Json = nlohmann::ordered_json;  // keeps the fixtures' key order, as Python does

namespace {

const std::string kFixtures = std::string(FT_TEST_DIR) + "/template/fixtures";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Json read_json(const std::string& name) { return Json::parse(read_file(kFixtures + "/" + name)); }

RenderOptions fixture_options(const Json& doc) {
  RenderOptions o;
  o.now = doc["meta"]["strftime_now_epoch"].get<std::time_t>();
  return o;
}

// Renders, or returns the error's message prefixed with "ERROR: ".
std::string render_or_error(const std::string& source, const Json& vars, const RenderOptions& o,
                            const std::string& origin = "test") {
  try {
    return Template(source, origin).render(vars, o);
  } catch (const TemplateError& e) {
    return std::string("ERROR: ") + e.what();
  }
}

std::string render(const std::string& source, const Json& vars = Json::object()) {
  return Template(source, "test.jinja").render(vars);
}

std::string error_of(const std::string& source, const Json& vars = Json::object(),
                     const RenderOptions& o = {}) {
  try {
    Template(source, "test.jinja").render(vars, o);
  } catch (const TemplateError& e) {
    return e.what();
  }
  FAIL("no TemplateError for: " << source);
  return "";
}

}  // namespace

TEST_CASE("real chat templates render every conversation exactly as transformers does") {
  const Json doc = read_json("conversations.json");
  const RenderOptions o = fixture_options(doc);
  std::set<std::string> templates;
  size_t outputs = 0, errors = 0;
  for (const Json& c : doc["cases"]) {
    const std::string name = c["template"];
    templates.insert(name);
    const std::string source = read_file(kFixtures + "/templates/" + name + ".jinja");
    INFO(name << " / " << c["conversation"].get<std::string>());
    const std::string got = render_or_error(source, c["variables"], o, name + ".jinja");
    if (c.contains("output")) {
      ++outputs;
      CHECK(got == c["output"].get<std::string>());
    } else {
      ++errors;
      // transformers raises the template's own message (raise_exception); ft names the place.
      CHECK(got.rfind("ERROR: " + name + ".jinja:", 0) == 0);
      CHECK(got.find("the template raised an error: " + c["error"].get<std::string>()) !=
            std::string::npos);
    }
  }
  // Every family the fixture promises, each rendered and each refusing something.
  CHECK(templates.size() == 13);
  CHECK(outputs > 150);
  CHECK(errors >= 6);
}

TEST_CASE("snippets render as jinja2 renders them in transformers' environment") {
  const Json doc = read_json("snippets.json");
  const RenderOptions o = fixture_options(doc);
  size_t n = 0;
  for (const Json& c : doc["cases"]) {
    const std::string name = c["name"];
    INFO(name << ": " << c["source"].get<std::string>());
    const std::string got = render_or_error(c["source"], c["variables"], o, "snippet.jinja");
    if (c.contains("output")) {
      CHECK(got == c["output"].get<std::string>());
    } else {
      const std::string want = c["error"];
      INFO("jinja2: " << want);
      REQUIRE(got.rfind("ERROR: snippet.jinja:", 0) == 0);
      if (c.contains("error_line")) {
        CHECK(got.find("snippet.jinja:" + std::to_string(c["error_line"].get<int>()) + ":") !=
              std::string::npos);
      }
      if (want.rfind("TemplateError: ", 0) == 0) {  // raise_exception: the message itself
        CHECK(got.find(want.substr(15)) != std::string::npos);
      }
    }
    ++n;
  }
  CHECK(n >= 90);
}

TEST_CASE("syntax errors name the origin, line and column with the line quoted") {
  CHECK(error_of("a\n{% if x %}\nb") ==
        "test.jinja:3:2: unexpected end of template: expected 'elif' or 'else' or 'endif' to "
        "close the open block\n  b\n   ^");
  const std::string e = error_of("line\n  {{ 1 + }}");
  CHECK(e.rfind("test.jinja:2:10: expected an expression, got '}}'", 0) == 0);
  CHECK(e.find("\n    {{ 1 + }}\n           ^") != std::string::npos);
  CHECK(error_of("{% frob %}").rfind("test.jinja:1:4: unknown tag 'frob'", 0) == 0);
  CHECK(error_of("x {# open").rfind("test.jinja:1:3: comment `{#` is never closed", 0) == 0);
  CHECK(error_of("{{ 'abc }}").rfind("test.jinja:1:4: string literal is never closed", 0) == 0);
  CHECK(error_of("{% include 'x' %}").find("not supported") != std::string::npos);
  CHECK(error_of("{% break %}").find("outside a for loop") != std::string::npos);
  CHECK(error_of("{{ x ) }}").rfind("test.jinja:1:6: unexpected ')'", 0) == 0);
  // Column counts characters, not bytes.
  CHECK(error_of("日本 {{ ) }}").rfind("test.jinja:1:7:", 0) == 0);
}

TEST_CASE("runtime errors name the expression's line and column") {
  CHECK(error_of("ok\n  {{ x.y.z }}").rfind("test.jinja:2:7: 'x' is undefined", 0) == 0);
  CHECK(error_of("{{ 1 + 'a' }}")
            .rfind("test.jinja:1:6: unsupported operand type(s) for +: 'int' and 'str'", 0) == 0);
  CHECK(error_of("{% for m in none %}{% endfor %}")
            .rfind("test.jinja:1:13: 'NoneType' object is not iterable", 0) == 0);
  const std::string raised = error_of("{{ raise_exception('roles must alternate') }}");
  CHECK(raised.rfind("test.jinja:1:19: the template raised an error: roles must alternate", 0) ==
        0);
  CHECK(error_of("{% set d = {} %}{% set d.x = 1 %}").find("not a namespace()") !=
        std::string::npos);
  CHECK(error_of("{{ [1]|nosuch }}").find("no filter named 'nosuch'") != std::string::npos);
  CHECK(error_of("{% set a, b = [1] %}").find("not enough values to unpack") != std::string::npos);
}

TEST_CASE("hostile templates are refused with a TemplateError, never a crash") {
  // Nesting beyond the parser's limit.
  CHECK(error_of("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
            .find("nesting deeper than") != std::string::npos);
  CHECK(error_of(std::string(3000, '-').insert(0, "{{ ") + "1 }}").find("nesting deeper than") !=
        std::string::npos);
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  CHECK(error_of(ifs).find("nesting deeper than") != std::string::npos);
  // Unbounded recursion, ranges, loops and output.
  CHECK(error_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").find("nested deeper") !=
        std::string::npos);
  CHECK(error_of("{{ range(100001)|length }}").find("MAX_RANGE") != std::string::npos);
  RenderOptions small;
  small.max_steps = 100000;
  CHECK(error_of("{% for a in range(1000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}",
                 Json::object(), small)
            .find("steps; refused") != std::string::npos);
  CHECK(error_of("{{ 'x' * 100000000 }}").find("size limit") != std::string::npos);
  small.max_output_bytes = 1000;
  CHECK(error_of("{% for a in range(1000) %}xx{% endfor %}", Json::object(), small)
            .find("output exceeds 1000 bytes") != std::string::npos);
  CHECK(error_of("{{ 9223372036854775807 + 1 }}").find("integer overflow") != std::string::npos);
  // Every prefix of a real template, and random byte changes to it: output or TemplateError.
  const std::string source = read_file(kFixtures + "/templates/llama-3.1-instruct.jinja");
  const Json vars = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"add_generation_prompt", true}};
  std::mt19937 rng(1234);
  size_t refused = 0, rendered = 0;
  auto attempt = [&](const std::string& text) {
    try {
      Template(text, "fuzz").render(vars);
      ++rendered;
    } catch (const TemplateError&) {
      ++refused;
    }
  };
  for (size_t n = 0; n < source.size(); n += 37) attempt(source.substr(0, n));
  const std::string alphabet = "{}%#-+()[]'\".|~=<>,: \nabx0";
  for (int i = 0; i < 400; ++i) {
    std::string t = source;
    for (int k = 0; k < 3; ++k) {
      t[rng() % t.size()] = alphabet[rng() % alphabet.size()];
    }
    attempt(t);
  }
  CHECK(refused > 100);
  CHECK(rendered > 10);
}

TEST_CASE("the variables, strftime_now's clock and undefined names") {
  CHECK(render("{{ bos_token }}{{ messages[0].content }}",
               {{"bos_token", "<s>"}, {"messages", {{{"content", "x"}}}}}) == "<s>x");
  RenderOptions o;
  o.now = 43200;  // 1970-01-01 12:00 UTC: the 1st in every time zone within 11 hours of UTC
  CHECK(Template("{{ strftime_now('%d %b %Y') }}", "t").render(Json::object(), o) == "01 Jan 1970");
  // An undefined name renders empty and is falsy; its attribute is an error naming it.
  CHECK(render("[{{ nope }}]{% if nope %}x{% endif %}") == "[]");
  CHECK(error_of("{{ nope.attr }}").find("'nope' is undefined") != std::string::npos);
  // A template is reusable and renders the same each time.
  const Template t("{% for m in messages %}{{ loop.index }}{{ m }}{% endfor %}", "t");
  const Json v = {{"messages", {"a", "b"}}};
  CHECK(t.render(v) == "1a2b");
  CHECK(t.render(v) == "1a2b");
}
