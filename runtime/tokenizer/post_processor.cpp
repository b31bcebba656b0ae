#include "tokenizer/post_processor.h"

namespace ft::tokenizer {

PostProcessor::PostProcessor(const Json& post_processor, const std::string& key,
                             const JsonFields& f) {
  parse(post_processor, key, f);
}

void PostProcessor::parse(const Json& p, const std::string& key, const JsonFields& f) {
  const std::string type = f.type_of(p, key);
  if (type == "Sequence") {
    const Json& list = f.array(p, key, "processors");
    for (size_t i = 0; i < list.size(); ++i) {
      parse(list[i], JsonFields::index(JsonFields::join(key, "processors"), i), f);
    }
    return;
  }
  if (type == "ByteLevel") return;  // offsets only
  if (type != "TemplateProcessing") {
    f.unsupported(key, "post_processor", type, "TemplateProcessing, ByteLevel, Sequence");
  }
  if (has_template_) f.fail(key, "more than one TemplateProcessing");
  has_template_ = true;

  // special_tokens: {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}, ...}
  const Json& specials = f.object(p, key, "special_tokens");
  const std::string skey = JsonFields::join(key, "special_tokens");
  const Json& single = f.array(p, key, "single");
  const std::string tkey = JsonFields::join(key, "single");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const Json& piece = single[i];
    const std::string pkey = JsonFields::index(tkey, i);
    if (const Json* seq = f.optional(piece, "Sequence")) {
      const std::string id = f.string(*seq, JsonFields::join(pkey, "Sequence"), "id");
      if (id != "A") {
        f.fail(JsonFields::join(pkey, "Sequence.id"),
               "the single template can only hold sequence A, got \"" + id + "\"");
      }
      if (seen_sequence) f.fail(pkey, "sequence A appears twice in the single template");
      seen_sequence = true;
    } else if (const Json* special = f.optional(piece, "SpecialToken")) {
      const std::string name = f.string(*special, JsonFields::join(pkey, "SpecialToken"), "id");
      const auto it = specials.find(name);
      if (it == specials.end()) f.fail(skey, "no entry for \"" + name + "\" used by " + pkey);
      const std::string ekey = skey + "[\"" + name + "\"]";
      const Json& ids = f.array(*it, ekey, "ids");
      std::vector<int32_t>& target = seen_sequence ? suffix_ : prefix_;
      for (size_t j = 0; j < ids.size(); ++j) {
        if (!ids[j].is_number_integer() || ids[j].get<int64_t>() < 0 ||
            ids[j].get<int64_t>() > INT32_MAX) {
          f.fail(JsonFields::index(JsonFields::join(ekey, "ids"), j), "expected a token id");
        }
        target.push_back(static_cast<int32_t>(ids[j].get<int64_t>()));
      }
    } else {
      f.fail(pkey, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got " + piece.dump());
    }
  }
  if (!seen_sequence) f.fail(tkey, "the single template has no sequence A");
}

std::vector<int32_t> PostProcessor::apply(const std::vector<int32_t>& ids) const {
  std::vector<int32_t> out;
  out.reserve(prefix_.size() + ids.size() + suffix_.size());
  out.insert(out.end(), prefix_.begin(), prefix_.end());
  out.insert(out.end(), ids.begin(), ids.end());
  out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

}  // namespace ft::tokenizer
