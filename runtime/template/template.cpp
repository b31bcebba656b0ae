#include "template/template.h"

#include <unordered_map>

#include "template/builtins.h"
#include "template/lexer.h"
#include "template/parser.h"

namespace ft::jinja {
namespace {

// Macro calls nest at most this deep (a recursive macro on hostile input).
constexpr int kMaxCallDepth = 64;

// Variables of one scope. A for loop's body gets a new frame per iteration (assignments inside do
// not outlive it, as in jinja2); if-blocks share their enclosing frame; a macro call's frame has
// the macro's defining frame as parent.
struct Frame {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Frame> parent;

  const Value* lookup(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get()) {
      auto it = f->vars.find(name);
      if (it != f->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using FramePtr = std::shared_ptr<Frame>;

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  Renderer(const Source& src, const RenderOptions& opt) : src_(src), opt_(opt) {}

  std::string run(const Body& body, const Value& variables) {
    auto globals = std::make_shared<Frame>();
    const Dict g = make_globals(opt_.now);
    for (auto& [k, v] : g->items) globals->vars[k] = v;
    auto root = std::make_shared<Frame>();
    root->parent = globals;
    if (!variables.is_dict() && !variables.is_none()) {
      throw TemplateError(src_.origin() + ": the variables of a render must be a JSON object");
    }
    if (variables.is_dict()) {
      for (const auto& [k, v] : variables.as_dict()->items) root->vars[k] = v;
    }
    std::string out;
    out_ = &out;
    exec(body, root);
    return out;
  }

 private:
  // --- statements
  Flow exec(const Body& body, const FramePtr& frame) {
    for (const StmtPtr& s : body) {
      const Flow f = exec(*s, frame);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  void step(Pos pos) {
    if (++steps_ > opt_.max_steps) {
      src_.fail(pos, detail::cat("the template ran more than ", opt_.max_steps,
                                 " steps; refused (a runaway loop?)"));
    }
  }

  void emit(const std::string& s, Pos pos) {
    *out_ += s;
    if (out_->size() > opt_.max_output_bytes) {
      src_.fail(pos, detail::cat("the output exceeds ", opt_.max_output_bytes, " bytes; refused"));
    }
  }

  Flow exec(const Stmt& s, const FramePtr& frame) {
    step(s.pos);
    switch (s.kind) {
      case StmtKind::kText:
        emit(s.text, s.pos);
        return Flow::kNormal;
      case StmtKind::kOutput:
        emit(eval(*s.expr, frame).str(), s.pos);
        return Flow::kNormal;
      case StmtKind::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (eval(*cond, frame).truthy()) return exec(body, frame);
        }
        return exec(s.otherwise, frame);
      case StmtKind::kFor:
        return exec_for(s, frame);
      case StmtKind::kSet:
        exec_set(s, frame);
        return Flow::kNormal;
      case StmtKind::kSetBlock:
        frame->vars[s.text] = Value(capture(s.body, frame));
        return Flow::kNormal;
      case StmtKind::kMacro:
        frame->vars[s.text] = make_macro(s, frame);
        return Flow::kNormal;
      case StmtKind::kCallBlock:
        emit(exec_call_block(s, frame).str(), s.pos);
        return Flow::kNormal;
      case StmtKind::kFilterBlock:
        emit(apply_chain(*s.expr, Value(capture(s.body, frame)), frame).str(), s.pos);
        return Flow::kNormal;
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
      case StmtKind::kScope:
        return exec(s.body, frame);
    }
    return Flow::kNormal;
  }

  std::string capture(const Body& body, const FramePtr& frame) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    try {
      exec(body, frame);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buf;
  }

  void bind(const std::vector<std::string>& targets, const Value& v, Frame& f, Pos pos) {
    if (targets.size() == 1) {
      f.vars[targets[0]] = v;
      return;
    }
    if (!v.is_list()) {
      src_.fail(pos,
                detail::cat("cannot unpack a ", v.type_name(), " into ", targets.size(), " names"));
    }
    const auto& items = v.as_list()->items;
    if (items.size() != targets.size()) {
      src_.fail(pos, detail::cat(items.size() < targets.size() ? "not enough" : "too many",
                                 " values to unpack (expected ", targets.size(), ", got ",
                                 items.size(), ")"));
    }
    for (size_t i = 0; i < items.size(); ++i) f.vars[targets[i]] = items[i];
  }

  Flow exec_for(const Stmt& s, const FramePtr& frame) {
    const Value seq = eval(*s.expr, frame);
    std::vector<Value> items;
    try {
      items = iterate(seq);
    } catch (const EvalError& e) {
      src_.fail(s.expr->pos, e.what());
    }
    if (s.filter) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        step(s.pos);
        auto f = std::make_shared<Frame>();
        f->parent = frame;
        bind(s.targets, item, *f, s.pos);
        if (eval(*s.filter, f).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(s.otherwise, frame);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      step(s.pos);
      auto f = std::make_shared<Frame>();
      f->parent = frame;
      bind(s.targets, items[static_cast<size_t>(i)], *f, s.pos);
      Value loop = Value::dict();
      DictObject& l = *loop.as_dict();
      l.set("index", Value(i + 1));
      l.set("index0", Value(i));
      l.set("revindex", Value(n - i));
      l.set("revindex0", Value(n - i - 1));
      l.set("first", Value(i == 0));
      l.set("last", Value(i == n - 1));
      l.set("length", Value(n));
      l.set("depth", Value(int64_t{1}));
      l.set("depth0", Value(int64_t{0}));
      if (i > 0) l.set("previtem", items[static_cast<size_t>(i - 1)]);
      if (i + 1 < n) l.set("nextitem", items[static_cast<size_t>(i + 1)]);
      auto cyc = std::make_shared<Function>();
      cyc->name = "loop.cycle";
      cyc->call = [i](CallArgs& a) -> Value {
        if (a.positional.empty()) throw EvalError("loop.cycle() needs at least one value");
        return a.positional[static_cast<size_t>(i) % a.positional.size()];
      };
      l.set("cycle", Value(cyc));
      f->vars["loop"] = loop;
      if (exec(s.body, f) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  void exec_set(const Stmt& s, const FramePtr& frame) {
    Value v = eval(*s.expr, frame);
    if (!s.filter) {
      bind(s.targets, v, *frame, s.pos);
      return;
    }
    const Value obj = eval(*s.filter, frame);
    if (!obj.is_dict() || !obj.as_dict()->is_namespace) {
      src_.fail(s.pos, detail::cat("cannot assign attribute '", s.text, "' on '", s.filter->name,
                                   "': it is not a namespace() (it is ",
                                   obj.is_undefined() ? "undefined" : obj.type_name(), ")"));
    }
    if (!s.text.empty() && s.text[0] == '_') {
      src_.fail(s.pos, detail::cat("Chat templates cannot store underscore-prefixed attributes on "
                                   "a namespace, but got '",
                                   s.text, "'"));
    }
    obj.as_dict()->set(s.text, std::move(v));
  }

  // A macro (or a call block's caller): a callable that renders `body` in a new frame whose
  // parent is the frame it was defined in.
  Value make_macro(const Stmt& s, const FramePtr& frame) {
    std::weak_ptr<Frame> weak = frame;
    Renderer* self = this;
    const Stmt* def = &s;
    auto fn = std::make_shared<Function>();
    fn->name = s.kind == StmtKind::kMacro ? s.text : "caller";
    fn->call = [self, def, weak](CallArgs& a) -> Value {
      FramePtr parent = weak.lock();
      if (!parent) throw EvalError("a macro was called after its scope ended");
      return Value(self->call_macro(*def, parent, a));
    };
    return Value(fn);
  }

  std::string call_macro(const Stmt& def, const FramePtr& parent, CallArgs& a) {
    if (++call_depth_ > kMaxCallDepth) {
      --call_depth_;
      src_.fail(def.pos,
                detail::cat("macro calls nested deeper than ", kMaxCallDepth, " levels; refused"));
    }
    struct Guard {
      int& d;
      ~Guard() { --d; }
    } guard{call_depth_};
    auto f = std::make_shared<Frame>();
    f->parent = parent;
    const std::string name = def.kind == StmtKind::kMacro ? def.text : "caller";
    if (a.positional.size() > def.targets.size()) {
      throw EvalError(detail::cat("macro '", name, "' takes not more than ", def.targets.size(),
                                  " argument(s), got ", a.positional.size()));
    }
    std::vector<bool> given(def.targets.size(), false);
    for (size_t i = 0; i < a.positional.size(); ++i) {
      f->vars[def.targets[i]] = a.positional[i];
      given[i] = true;
    }
    for (auto& [k, v] : a.keyword) {
      if (k == "caller") {
        f->vars["caller"] = v;
        continue;
      }
      auto it = std::find(def.targets.begin(), def.targets.end(), k);
      if (it == def.targets.end()) {
        throw EvalError(detail::cat("macro '", name, "' takes no keyword argument '", k, "'"));
      }
      const size_t i = static_cast<size_t>(it - def.targets.begin());
      f->vars[k] = v;
      given[i] = true;
    }
    for (size_t i = 0; i < def.targets.size(); ++i) {
      if (given[i]) continue;
      f->vars[def.targets[i]] =
          def.defaults[i] ? eval(*def.defaults[i], f)
                          : Value::undefined(detail::cat("'", def.targets[i], "' is undefined"));
    }
    return capture(def.body, f);
  }

  Value exec_call_block(const Stmt& s, const FramePtr& frame) {
    const Expr& c = *s.expr;
    const Value callee = eval(*c.object, frame);
    CallArgs args = eval_args(c, frame);
    args.keyword.emplace_back("caller", make_macro(s, frame));
    return guarded(c.pos, [&] { return call(callee, args); });
  }

  // --- expressions
  template <class F>
  Value guarded(Pos pos, F&& f) {
    try {
      return f();
    } catch (const RaisedError& e) {
      src_.fail(pos, detail::cat("the template raised an error: ", e.what()));
    } catch (const EvalError& e) {
      src_.fail(pos, e.what());
    }
  }

  CallArgs eval_args(const Expr& e, const FramePtr& frame) {
    CallArgs args;
    for (const ExprPtr& a : e.items) args.positional.push_back(eval(*a, frame));
    for (const auto& [k, a] : e.kwargs) args.keyword.emplace_back(k, eval(*a, frame));
    return args;
  }

  Value apply_chain(const Expr& f, Value base, const FramePtr& frame) {
    // A filter block's chain ends in no object: the block's output (`base`) is filtered.
    Value target = !f.object ? std::move(base)
                   : f.object->kind == ExprKind::kFilter
                       ? apply_chain(*f.object, std::move(base), frame)
                       : eval(*f.object, frame);
    CallArgs args = eval_args(f, frame);
    return guarded(f.pos, [&] { return apply_filter(f.name, target, args); });
  }

  Value eval(const Expr& e, const FramePtr& frame) {
    switch (e.kind) {
      case ExprKind::kLiteral:
        return e.value;
      case ExprKind::kName: {
        if (const Value* v = frame->lookup(e.name)) return *v;
        return Value::undefined(detail::cat("'", e.name, "' is undefined"));
      }
      case ExprKind::kList: {
        std::vector<Value> items;
        for (const ExprPtr& x : e.items) items.push_back(eval(*x, frame));
        return Value::list(std::move(items), e.flag);
      }
      case ExprKind::kDict: {
        Value d = Value::dict();
        for (size_t i = 0; i < e.keys.size(); ++i) {
          const Value k = eval(*e.keys[i], frame);
          if (!k.is_string()) {
            src_.fail(e.keys[i]->pos, detail::cat("dict keys must be strings in ft's Jinja "
                                                  "engine, got ",
                                                  k.type_name()));
          }
          d.as_dict()->set(k.as_string(), eval(*e.items[i], frame));
        }
        return d;
      }
      case ExprKind::kGetAttr: {
        const Value obj = eval(*e.object, frame);
        return guarded(e.pos, [&] { return get_attr(obj, e.name); });
      }
      case ExprKind::kGetItem: {
        const Value obj = eval(*e.object, frame);
        const Value key = eval(*e.a, frame);
        return guarded(e.pos, [&] { return get_item(obj, key); });
      }
      case ExprKind::kSlice: {
        const Value obj = eval(*e.object, frame);
        const Value a = e.a ? eval(*e.a, frame) : Value();
        const Value b = e.b ? eval(*e.b, frame) : Value();
        const Value c = e.c ? eval(*e.c, frame) : Value();
        return guarded(e.pos, [&] { return slice(obj, a, b, c); });
      }
      case ExprKind::kCall: {
        const Value callee = eval(*e.object, frame);
        CallArgs args = eval_args(e, frame);
        return guarded(e.pos, [&] { return call(callee, args); });
      }
      case ExprKind::kFilter:
        return apply_chain(e, Value(), frame);
      case ExprKind::kTest: {
        const Value obj = eval(*e.object, frame);
        CallArgs args = eval_args(e, frame);
        const bool r =
            guarded(e.pos, [&] { return Value(apply_test(e.name, obj, args)); }).as_bool();
        return Value(e.flag ? !r : r);
      }
      case ExprKind::kUnary: {
        const Value v = eval(*e.a, frame);
        if (e.name == "not") return Value(!v.truthy());
        return guarded(e.pos, [&]() -> Value {
          if (e.name == "+") {
            if (!v.is_number())
              throw EvalError(detail::cat("bad operand type for unary +: '", v.type_name(), "'"));
            return v.is_bool() ? Value(static_cast<int64_t>(v.as_bool())) : v;
          }
          if (v.is_int()) {
            if (v.as_int() == INT64_MIN) throw EvalError("integer overflow in unary '-'");
            return Value(-v.as_int());
          }
          if (v.is_bool()) return Value(-static_cast<int64_t>(v.as_bool()));
          if (v.is_float()) return Value(-v.as_float());
          if (v.is_undefined()) throw EvalError(v.as_undefined().hint);
          throw EvalError(detail::cat("bad operand type for unary -: '", v.type_name(), "'"));
        });
      }
      case ExprKind::kBinary: {
        if (e.name == "and") {
          Value l = eval(*e.a, frame);
          return l.truthy() ? eval(*e.b, frame) : l;
        }
        if (e.name == "or") {
          Value l = eval(*e.a, frame);
          return l.truthy() ? l : eval(*e.b, frame);
        }
        const Value l = eval(*e.a, frame);
        const Value r = eval(*e.b, frame);
        return guarded(e.pos, [&] { return binary_op(e.name, l, r); });
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.a, frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], frame);
          const std::string& op = e.ops[i];
          const bool ok =
              guarded(e.items[i]->pos, [&] { return Value(compare(op, left, right)); }).as_bool();
          if (!ok) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::kCondition: {
        if (eval(*e.b, frame).truthy()) return eval(*e.a, frame);
        if (e.c) return eval(*e.c, frame);
        return Value::undefined("the condition of an inline if was false and it has no else");
      }
    }
    return Value();
  }

  static bool compare(const std::string& op, const Value& l, const Value& r) {
    if (op == "==") return equal(l, r);
    if (op == "!=") return !equal(l, r);
    if (op == "in") return contains(r, l);
    if (op == "not in") return !contains(r, l);
    if (l.is_undefined()) throw EvalError(l.as_undefined().hint);
    if (r.is_undefined()) throw EvalError(r.as_undefined().hint);
    bool ok = true;
    bool res = false;
    if (op == "<") res = less(l, r, &ok);
    if (op == ">") res = less(r, l, &ok);
    if (op == "<=") res = !less(r, l, &ok);
    if (op == ">=") res = !less(l, r, &ok);
    if (!ok) {
      throw EvalError(detail::cat("'", op, "' not supported between instances of '", l.type_name(),
                                  "' and '", r.type_name(), "'"));
    }
    return res;
  }

  const Source& src_;
  const RenderOptions& opt_;
  std::string* out_ = nullptr;
  size_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

Template::Template(std::string text, std::string origin) {
  auto src = std::make_shared<Source>(std::move(text), std::move(origin));
  const std::vector<Token> tokens = tokenize(*src);
  body_ = std::make_shared<const Body>(parse(tokens, *src));
  source_ = std::move(src);
}

std::string Template::render(const nlohmann::ordered_json& variables,
                             const RenderOptions& options) const {
  Renderer r(*source_, options);
  return r.run(*body_, from_json(variables));
}

std::string Template::render(const nlohmann::json& variables, const RenderOptions& options) const {
  Renderer r(*source_, options);
  return r.run(*body_, from_json(variables));
}

}  // namespace ft::jinja
