#include "tokenizer/normalizer.h"

namespace ft::tokenizer {

std::string replace_all(const std::string& text, const std::string& pattern,
                        const std::string& content) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  for (size_t hit = text.find(pattern); hit != std::string::npos; hit = text.find(pattern, pos)) {
    out.append(text, pos, hit - pos);
    out += content;
    pos = hit + pattern.size();
  }
  out.append(text, pos, std::string::npos);
  return out;
}

Normalizer::Normalizer(const Json& normalizer, const std::string& key, const JsonFields& f) {
  parse(normalizer, key, f);
}

void Normalizer::parse(const Json& n, const std::string& key, const JsonFields& f) {
  const std::string type = f.type_of(n, key);
  if (type == "Sequence") {
    const Json& list = f.array(n, key, "normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parse(list[i], JsonFields::index(JsonFields::join(key, "normalizers"), i), f);
    }
  } else if (type == "Prepend") {
    steps_.push_back(Step{Step::Kind::kPrepend, {}, f.string(n, key, "prepend")});
  } else if (type == "Replace") {
    const Json& pattern = f.object(n, key, "pattern");
    const std::string pkey = JsonFields::join(key, "pattern");
    if (f.optional(pattern, "String") == nullptr) {
      f.fail(pkey,
             "only {\"String\": ...} patterns are supported for Replace, got " + pattern.dump());
    }
    std::string literal = f.string(pattern, pkey, "String");
    if (literal.empty()) f.fail(JsonFields::join(pkey, "String"), "empty pattern");
    steps_.push_back(Step{Step::Kind::kReplace, std::move(literal), f.string(n, key, "content")});
  } else {
    f.unsupported(key, "normalizer", type, "Sequence, Prepend, Replace");
  }
}

void Normalizer::normalize(std::string& text) const {
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::Kind::kPrepend:
        // HF prepends only to non-empty text.
        if (!text.empty()) text.insert(0, s.content);
        break;
      case Step::Kind::kReplace:
        text = replace_all(text, s.pattern, s.content);
        break;
    }
  }
}

}  // namespace ft::tokenizer
