#include "template/parser.h"

#include <set>

namespace ft::jinja {
namespace {

class Parser {
 public:
  Parser(const std::vector<Token>& t, const Source& s) : t_(t), src_(s) {}

  Body run() {
    std::string end_tag;
    Body body = parse_body({}, &end_tag);
    return body;
  }

 private:
  // --- token helpers
  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(i_ + n, t_.size() - 1)]; }
  void next() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool is_op(const char* op) const { return cur().kind == Tok::kOp && cur().text == op; }
  bool is_name(const char* n) const { return cur().kind == Tok::kName && cur().text == n; }
  [[noreturn]] void fail(const std::string& msg) const { src_.fail(cur().pos, msg); }
  std::string describe(const Token& t) const {
    switch (t.kind) {
      case Tok::kText:
        return "template text";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kVarEnd:
        return "'}}'";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kBlockEnd:
        return "'%}'";
      case Tok::kEnd:
        return "the end of the template";
      case Tok::kString:
        return "a string";
      default:
        return "'" + t.text + "'";
    }
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(detail::cat("expected '", op, "', got ", describe(cur())));
    next();
  }
  std::string expect_name(const char* what) {
    if (cur().kind != Tok::kName) fail(detail::cat("expected ", what, ", got ", describe(cur())));
    std::string n = cur().text;
    next();
    return n;
  }
  void expect_block_end(const char* tag) {
    if (cur().kind != Tok::kBlockEnd) {
      fail(detail::cat("expected '%}' to end the '", tag, "' tag, got ", describe(cur())));
    }
    next();
  }

  struct Depth {
    Depth(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting) {
        p_.fail(detail::cat("nesting deeper than ", kMaxNesting, " levels; refused"));
      }
    }
    ~Depth() { --p_.depth_; }
    Parser& p_;
  };

  // --- statements
  // Parses until a block tag whose name is in `ends` ({% name ...), leaving i_ on that name.
  Body parse_body(const std::set<std::string>& ends, std::string* end_tag) {
    Depth d(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == Tok::kEnd) {
        if (!ends.empty()) {
          std::string want;
          for (const auto& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
          fail(detail::cat("unexpected end of template: expected ", want,
                           " to close the open block"));
        }
        return body;
      }
      if (t.kind == Tok::kText) {
        auto s = std::make_unique<Stmt>(StmtKind::kText, t.pos);
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.kind == Tok::kVarBegin) {
        next();
        auto s = std::make_unique<Stmt>(StmtKind::kOutput, t.pos);
        s->expr = parse_tuple_or_expr();
        if (cur().kind != Tok::kVarEnd) fail("expected '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(s));
      } else if (t.kind == Tok::kBlockBegin) {
        next();
        if (cur().kind != Tok::kName)
          fail("expected a tag name after '{%', got " + describe(cur()));
        if (ends.count(cur().text)) {
          *end_tag = cur().text;
          return body;
        }
        body.push_back(parse_statement());
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    const std::string& n = t.text;
    if (n == "if") return parse_if();
    if (n == "for") return parse_for();
    if (n == "set") return parse_set();
    if (n == "macro") return parse_macro();
    if (n == "call") return parse_call_block();
    if (n == "filter") return parse_filter_block();
    if (n == "generation") {
      auto s = std::make_unique<Stmt>(StmtKind::kScope, t.pos);
      next();
      expect_block_end("generation");
      std::string end;
      s->body = parse_body({"endgeneration"}, &end);
      next();
      expect_block_end("endgeneration");
      return s;
    }
    if (n == "break" || n == "continue") {
      if (loop_depth_ == 0) fail(detail::cat("'", n, "' outside a for loop"));
      auto s = std::make_unique<Stmt>(n == "break" ? StmtKind::kBreak : StmtKind::kContinue, t.pos);
      next();
      expect_block_end(n == "break" ? "break" : "continue");
      return s;
    }
    static const std::set<std::string> kUnsupported = {
        "include", "extends", "import", "from", "block", "raw", "with", "autoescape", "do"};
    if (kUnsupported.count(n)) {
      fail(detail::cat("the '", n,
                       "' tag is not supported by ft's Jinja engine (chat templates "
                       "do not use it)"));
    }
    fail(detail::cat("unknown tag '", n, "'"));
  }

  StmtPtr parse_if() {
    auto s = std::make_unique<Stmt>(StmtKind::kIf, cur().pos);
    next();
    while (true) {
      ExprPtr cond = parse_tuple_or_expr();
      expect_block_end("if");
      std::string end;
      Body body = parse_body({"elif", "else", "endif"}, &end);
      s->branches.emplace_back(std::move(cond), std::move(body));
      next();
      if (end == "elif") continue;
      if (end == "else") {
        expect_block_end("else");
        s->otherwise = parse_body({"endif"}, &end);
        next();
      }
      expect_block_end("endif");
      return s;
    }
  }

  void parse_targets(std::vector<std::string>& out, const char* tag) {
    const bool paren = is_op("(");
    if (paren) next();
    out.push_back(expect_name(detail::cat("a variable name in '", tag, "'").c_str()));
    while (is_op(",")) {
      next();
      if (cur().kind != Tok::kName) break;
      out.push_back(expect_name("a variable name"));
    }
    if (paren) expect_op(")");
  }

  StmtPtr parse_for() {
    auto s = std::make_unique<Stmt>(StmtKind::kFor, cur().pos);
    next();
    parse_targets(s->targets, "for");
    if (!is_name("in")) fail("expected 'in' in the 'for' tag, got " + describe(cur()));
    next();
    s->expr = parse_tuple_or_expr(/*no_condition=*/true);
    if (is_name("if")) {
      next();
      s->filter = parse_tuple_or_expr();
    }
    if (is_name("recursive")) fail("recursive for loops are not supported by ft's Jinja engine");
    expect_block_end("for");
    ++loop_depth_;
    std::string end;
    s->body = parse_body({"else", "endfor"}, &end);
    --loop_depth_;
    next();
    if (end == "else") {
      expect_block_end("else");
      s->otherwise = parse_body({"endfor"}, &end);
      next();
    }
    expect_block_end("endfor");
    return s;
  }

  StmtPtr parse_set() {
    const Pos pos = cur().pos;
    next();
    if (cur().kind == Tok::kName && peek().kind == Tok::kOp && peek().text == "." &&
        peek(2).kind == Tok::kName) {
      auto s = std::make_unique<Stmt>(StmtKind::kSet, pos);
      auto obj = std::make_unique<Expr>(ExprKind::kName, cur().pos);
      obj->name = cur().text;
      s->filter = std::move(obj);
      next();
      next();
      s->text = cur().text;
      next();
      expect_op("=");
      s->expr = parse_tuple_or_expr();
      expect_block_end("set");
      return s;
    }
    std::vector<std::string> targets;
    parse_targets(targets, "set");
    if (cur().kind == Tok::kBlockEnd) {
      if (targets.size() != 1) fail("a block set assigns one name");
      auto s = std::make_unique<Stmt>(StmtKind::kSetBlock, pos);
      s->text = targets[0];
      next();
      std::string end;
      s->body = parse_body({"endset"}, &end);
      next();
      expect_block_end("endset");
      return s;
    }
    auto s = std::make_unique<Stmt>(StmtKind::kSet, pos);
    s->targets = std::move(targets);
    expect_op("=");
    s->expr = parse_tuple_or_expr();
    expect_block_end("set");
    return s;
  }

  void parse_params(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.targets.empty()) expect_op(",");
      if (is_op(")")) break;
      s.targets.push_back(expect_name("a parameter name"));
      if (is_op("=")) {
        next();
        s.defaults.push_back(parse_expression());
      } else {
        s.defaults.push_back(nullptr);
      }
    }
    next();
  }

  StmtPtr parse_macro() {
    auto s = std::make_unique<Stmt>(StmtKind::kMacro, cur().pos);
    next();
    s->text = expect_name("a macro name");
    parse_params(*s);
    expect_block_end("macro");
    const int saved = loop_depth_;
    loop_depth_ = 0;
    std::string end;
    s->body = parse_body({"endmacro"}, &end);
    loop_depth_ = saved;
    next();
    expect_block_end("endmacro");
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = std::make_unique<Stmt>(StmtKind::kCallBlock, cur().pos);
    next();
    if (is_op("(")) parse_params(*s);
    s->expr = parse_expression();
    if (s->expr->kind != ExprKind::kCall) src_.fail(s->expr->pos, "expected a call in 'call'");
    expect_block_end("call");
    std::string end;
    s->body = parse_body({"endcall"}, &end);
    next();
    expect_block_end("endcall");
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = std::make_unique<Stmt>(StmtKind::kFilterBlock, cur().pos);
    next();
    ExprPtr chain;  // filters applied to a null object: the body
    do {
      if (chain) next();
      chain = parse_filter(std::move(chain));
    } while (is_op("|"));
    s->expr = std::move(chain);
    expect_block_end("filter");
    std::string end;
    s->body = parse_body({"endfilter"}, &end);
    next();
    expect_block_end("endfilter");
    return s;
  }

  // --- expressions
  ExprPtr parse_tuple_or_expr(bool no_condition = false) {
    const Pos pos = cur().pos;
    ExprPtr first = no_condition ? parse_or() : parse_expression();
    if (!is_op(",")) return first;
    auto t = std::make_unique<Expr>(ExprKind::kList, pos);
    t->flag = true;
    t->items.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (cur().kind == Tok::kBlockEnd || cur().kind == Tok::kVarEnd || is_op(")")) break;
      if (is_name("if") && no_condition) break;
      t->items.push_back(no_condition ? parse_or() : parse_expression());
    }
    return t;
  }

  ExprPtr parse_expression() {
    Depth d(*this);
    ExprPtr e = parse_or();
    while (is_name("if")) {
      auto c = std::make_unique<Expr>(ExprKind::kCondition, cur().pos);
      next();
      c->a = std::move(e);
      c->b = parse_or();
      if (is_name("else")) {
        next();
        c->c = parse_expression();
      }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const char* op, ExprPtr l, ExprPtr r, Pos pos) {
    auto b = std::make_unique<Expr>(ExprKind::kBinary, pos);
    b->name = op;
    b->a = std::move(l);
    b->b = std::move(r);
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      const Pos p = cur().pos;
      next();
      l = binary("or", std::move(l), parse_and(), p);
    }
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      const Pos p = cur().pos;
      next();
      l = binary("and", std::move(l), parse_not(), p);
    }
    return l;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      Depth d(*this);
      auto u = std::make_unique<Expr>(ExprKind::kUnary, cur().pos);
      next();
      u->name = "not";
      u->a = parse_not();
      return u;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const Pos pos = cur().pos;
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (cur().kind == Tok::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().kind == Tok::kName && peek().text == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = std::make_unique<Expr>(ExprKind::kCompare, pos);
        cmp->a = std::move(first);
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(parse_math1());
    }
    if (cmp) return cmp;
    return first;
  }
  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().text;
      const Pos p = cur().pos;
      next();
      l = binary(op == "+" ? "+" : "-", std::move(l), parse_concat(), p);
    }
    return l;
  }
  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      const Pos p = cur().pos;
      next();
      l = binary("~", std::move(l), parse_math2(), p);
    }
    return l;
  }
  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().text;
      const Pos p = cur().pos;
      next();
      ExprPtr r = parse_pow();
      auto b = std::make_unique<Expr>(ExprKind::kBinary, p);
      b->name = op;
      b->a = std::move(l);
      b->b = std::move(r);
      l = std::move(b);
    }
    return l;
  }
  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const Pos p = cur().pos;
      next();
      l = binary("**", std::move(l), parse_unary(true), p);
    }
    return l;
  }
  ExprPtr parse_unary(bool with_filter) {
    Depth d(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto u = std::make_unique<Expr>(ExprKind::kUnary, cur().pos);
      u->name = cur().text;
      next();
      u->a = parse_unary(false);
      node = std::move(u);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const Pos pos = t.pos;
    if (t.kind == Tok::kName) {
      const std::string& n = t.text;
      auto lit = [&](Value v) {
        auto e = std::make_unique<Expr>(ExprKind::kLiteral, pos);
        e->value = std::move(v);
        next();
        return e;
      };
      if (n == "true" || n == "True") return lit(Value(true));
      if (n == "false" || n == "False") return lit(Value(false));
      if (n == "none" || n == "None") return lit(Value(None{}));
      auto e = std::make_unique<Expr>(ExprKind::kName, pos);
      e->name = n;
      next();
      return e;
    }
    if (t.kind == Tok::kString) {
      std::string s;
      while (cur().kind == Tok::kString) {  // adjacent literals concatenate
        s += cur().text;
        next();
      }
      auto e = std::make_unique<Expr>(ExprKind::kLiteral, pos);
      e->value = Value(std::move(s));
      return e;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      auto e = std::make_unique<Expr>(ExprKind::kLiteral, pos);
      e->value = t.kind == Tok::kInt ? Value(t.int_value) : Value(t.float_value);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        auto e = std::make_unique<Expr>(ExprKind::kList, pos);
        e->flag = true;
        return e;
      }
      ExprPtr inner = parse_tuple_or_expr();
      expect_op(")");
      return inner;
    }
    if (is_op("[")) {
      next();
      auto e = std::make_unique<Expr>(ExprKind::kList, pos);
      while (!is_op("]")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("]")) break;
        e->items.push_back(parse_expression());
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = std::make_unique<Expr>(ExprKind::kDict, pos);
      while (!is_op("}")) {
        if (!e->keys.empty()) expect_op(",");
        if (is_op("}")) break;
        e->keys.push_back(parse_expression());
        expect_op(":");
        e->items.push_back(parse_expression());
      }
      next();
      return e;
    }
    fail("expected an expression, got " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".")) {
        const Pos p = cur().pos;
        next();
        auto g = std::make_unique<Expr>(ExprKind::kGetAttr, p);
        if (cur().kind == Tok::kName) {
          g->name = cur().text;
        } else if (cur().kind == Tok::kInt) {
          // x.0 is x[0]
          g->kind = ExprKind::kGetItem;
          auto idx = std::make_unique<Expr>(ExprKind::kLiteral, cur().pos);
          idx->value = Value(cur().int_value);
          g->a = std::move(idx);
        } else {
          fail("expected an attribute name after '.', got " + describe(cur()));
        }
        next();
        g->object = std::move(node);
        node = std::move(g);
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Pos p = cur().pos;
    next();
    ExprPtr parts[3];
    int colons = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        if (++colons > 2) fail("a slice has at most two ':'");
        next();
        continue;
      }
      if (parts[colons]) fail("expected ':' or ']' in a subscript, got " + describe(cur()));
      parts[colons] = parse_expression();
    }
    next();
    if (colons == 0) {
      if (!parts[0]) src_.fail(p, "empty subscript []");
      auto g = std::make_unique<Expr>(ExprKind::kGetItem, p);
      g->object = std::move(node);
      g->a = std::move(parts[0]);
      return g;
    }
    auto s = std::make_unique<Expr>(ExprKind::kSlice, p);
    s->object = std::move(node);
    s->a = std::move(parts[0]);
    s->b = std::move(parts[1]);
    s->c = std::move(parts[2]);
    return s;
  }

  void parse_args(Expr& call) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (cur().kind == Tok::kName && peek().kind == Tok::kOp && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        call.kwargs.emplace_back(std::move(key), parse_expression());
      } else {
        if (!call.kwargs.empty()) fail("a positional argument follows a keyword argument");
        call.items.push_back(parse_expression());
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    auto c = std::make_unique<Expr>(ExprKind::kCall, cur().pos);
    c->object = std::move(node);
    parse_args(*c);
    return c;
  }

  ExprPtr parse_filter(ExprPtr node) {
    auto f = std::make_unique<Expr>(ExprKind::kFilter, cur().pos);
    f->name = expect_name("a filter name");
    while (is_op(".") && peek().kind == Tok::kName) {  // dotted filter names
      next();
      f->name += "." + cur().text;
      next();
    }
    f->object = std::move(node);
    if (is_op("(")) parse_args(*f);
    return f;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        next();
        node = parse_filter(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_test(ExprPtr node) {
    auto t = std::make_unique<Expr>(ExprKind::kTest, cur().pos);
    next();
    if (is_name("not")) {
      t->flag = true;
      next();
    }
    t->name = expect_name("a test name after 'is'");
    t->object = std::move(node);
    if (is_op("(")) {
      parse_args(*t);
    } else if ((cur().kind == Tok::kName || cur().kind == Tok::kString || cur().kind == Tok::kInt ||
                cur().kind == Tok::kFloat || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("tests cannot be chained with 'is'");
      t->items.push_back(parse_postfix(parse_primary()));
    }
    return t;
  }

  const std::vector<Token>& t_;
  const Source& src_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Body parse(const std::vector<Token>& tokens, const Source& source) {
  return Parser(tokens, source).run();
}

}  // namespace ft::jinja
