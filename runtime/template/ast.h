// The syntax tree of a parsed template: expressions and statements, each with the position it
// was written at, for errors. Built by the parser, read by the renderer; immutable once built.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "template/source.h"
#include "template/value.h"

namespace ft::jinja {

enum class ExprKind {
  kLiteral,   // value
  kName,      // name
  kList,      // items (tuple: a tuple literal)
  kDict,      // keys, items
  kGetAttr,   // object.name
  kGetItem,   // object[index]
  kSlice,     // object[start:stop:step] (absent parts are null)
  kCall,      // callee(args, kwargs)
  kFilter,    // object | name(args, kwargs)
  kTest,      // object is [not] name(args)
  kUnary,     // op ("-", "+", "not") operand
  kBinary,    // left op right: + - * / // % ** ~ and or
  kCompare,   // left (ops[i] operands[i])*: == != < <= > >= in "not in"
  kCondition  // then if cond else otherwise (otherwise may be null)
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  Pos pos;
  Value value;                 // kLiteral
  std::string name;            // kName, kGetAttr, kFilter, kTest; the operator of kUnary/kBinary
  bool flag = false;           // kList: tuple; kTest: negated
  ExprPtr object, a, b, c;     // operands (meaning per kind, see above)
  std::vector<ExprPtr> items;  // list items, dict values, call arguments, compare operands
  std::vector<ExprPtr> keys;   // dict keys
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // kCompare

  Expr(ExprKind k, Pos p) : kind(k), pos(p) {}
};

enum class StmtKind {
  kText,         // text
  kOutput,       // {{ expr }}
  kIf,           // branches (cond, body), otherwise
  kFor,          // targets in expr [if filter]: body, otherwise
  kSet,          // targets = expr, or object.attr = expr (namespace)
  kSetBlock,     // {% set name %}body{% endset %}
  kMacro,        // name(params = defaults): body
  kCallBlock,    // {% call(params) expr %}body{% endcall %}
  kFilterBlock,  // {% filter f %}body{% endfilter %}
  kBreak,
  kContinue,
  kScope,  // a body rendered as is ({% generation %} of transformers' templates)
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  StmtKind kind;
  Pos pos;
  std::string text;                  // kText; the name of kSetBlock / kMacro; attr of kSet
  ExprPtr expr;                      // output, for iterable, set value, call, filter target
  ExprPtr filter;                    // for ... if filter; kSet: the namespace object
  std::vector<std::string> targets;  // for / set names; macro / caller parameters
  std::vector<ExprPtr> defaults;     // macro parameters' defaults (null where none)
  std::vector<std::pair<ExprPtr, Body>> branches;  // kIf
  Body body, otherwise;

  Stmt(StmtKind k, Pos p) : kind(k), pos(p) {}
};

}  // namespace ft::jinja
