#include "tokenizer/normalizer.h"

#include <stdexcept>

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

TextPattern TextPattern::parse(const Json& obj, const std::string& key, const char* name,
                               const JsonFields& f) {
  TextPattern t;
  const Json& pattern = f.object(obj, key, name);
  const std::string pkey = JsonFields::join(key, name);
  if (f.optional(pattern, "Regex") != nullptr) {
    try {
      t.regex = Regex::oniguruma(f.string(pattern, pkey, "Regex"));
    } catch (const std::invalid_argument& e) {
      f.fail(JsonFields::join(pkey, "Regex"), e.what());
    }
  } else if (f.optional(pattern, "String") != nullptr) {
    t.literal = f.string(pattern, pkey, "String");
    if (t.literal.empty()) f.fail(JsonFields::join(pkey, "String"), "empty pattern");
  } else {
    f.fail(pkey, "expected {\"Regex\": ...} or {\"String\": ...}, got " + pattern.dump());
  }
  return t;
}

void TextPattern::find_all(const std::string& text,
                           std::vector<std::pair<size_t, size_t>>& matches) const {
  matches.clear();
  if (text.empty()) return;  // HF finds nothing in empty text, even for "x*"
  if (regex) {
    regex->find_all(text, matches);
    return;
  }
  for (size_t hit = text.find(literal); hit != std::string::npos;
       hit = text.find(literal, hit + literal.size())) {
    matches.emplace_back(hit, hit + literal.size());
  }
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
    return;
  }
  Step step{};
  if (type == "Prepend") {
    step.kind = Step::Kind::kPrepend;
    step.content = f.string(n, key, "prepend");
  } else if (type == "Replace") {
    step.kind = Step::Kind::kReplace;
    step.pattern = TextPattern::parse(n, key, "pattern", f);
    step.content = f.string(n, key, "content");
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.kind = Step::Kind::kUnicode;
    step.form = type == "NFC"    ? NormalForm::kNfc
                : type == "NFD"  ? NormalForm::kNfd
                : type == "NFKC" ? NormalForm::kNfkc
                                 : NormalForm::kNfkd;
  } else if (type == "Lowercase") {
    step.kind = Step::Kind::kLowercase;
  } else if (type == "Strip") {
    step.kind = Step::Kind::kStrip;
    step.left = f.boolean(n, key, "strip_left", false);
    step.right = f.boolean(n, key, "strip_right", false);
  } else if (type == "StripAccents") {
    step.kind = Step::Kind::kStripAccents;
  } else if (type == "BertNormalizer") {
    step.kind = Step::Kind::kBert;
    step.clean_text = f.boolean(n, key, "clean_text", true);
    step.chinese_chars = f.boolean(n, key, "handle_chinese_chars", true);
    step.lowercase = f.boolean(n, key, "lowercase", true);
    // strip_accents null follows lowercase, as in HF.
    step.strip_accents = f.boolean(n, key, "strip_accents", step.lowercase);
  } else if (type == "Nmt") {
    step.kind = Step::Kind::kNmt;
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::kByteLevel;
  } else {
    f.unsupported(key, "normalizer", type,
                  "Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Prepend, Strip, "
                  "StripAccents, BertNormalizer, Nmt, ByteLevel");
  }
  steps_.push_back(std::move(step));
}

namespace {

// Keeps the characters for which `keep(cp)` holds, each replaced by `map(cp)`.
template <typename Keep, typename Map>
std::string filter_map(const std::string& text, Keep keep, Map map) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    const char32_t cp = decode_utf8(text, pos, &len);
    if (keep(cp)) {
      const char32_t m = map(cp);
      if (m == cp) {
        out.append(text, pos, len);
      } else {
        append_utf8(m, out);
      }
    }
    pos += len;
  }
  return out;
}

char32_t same(char32_t cp) { return cp; }

// The CJK ideograph blocks BertNormalizer puts spaces around.
bool is_chinese_char(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

void bert_normalize(std::string& text, bool clean_text, bool chinese, bool strip_accents,
                    bool lowercase) {
  if (clean_text) {
    // Control characters (other than \t \n \r, which count as white space), NUL and U+FFFD go;
    // every white space becomes " ".
    text = filter_map(
        text,
        [](char32_t c) {
          const bool ws = c == '\t' || c == '\n' || c == '\r';
          return !(c == 0 || c == 0xFFFD || (!ws && is_other(c)));
        },
        [](char32_t c) { return is_white_space(c) ? U' ' : c; });
  }
  if (chinese) {
    std::string out;
    out.reserve(text.size() + 8);
    for (size_t pos = 0; pos < text.size();) {
      size_t len = 0;
      const bool cjk = is_chinese_char(decode_utf8(text, pos, &len));
      if (cjk) out += ' ';
      out.append(text, pos, len);
      if (cjk) out += ' ';
      pos += len;
    }
    text = std::move(out);
  }
  if (strip_accents) {
    text = filter_map(
        normalize_form(text, NormalForm::kNfd), [](char32_t c) { return !is_nonspacing_mark(c); },
        same);
  }
  if (lowercase) text = lowercase_chars(text);
}

// Nmt: ASCII control characters removed, other spacing characters made " ".
char32_t nmt_space(char32_t c) {
  if (c == 0x09 || c == 0x0A || c == 0x0C || c == 0x0D || c == 0x1680 ||
      (c >= 0x200B && c <= 0x200F) || c == 0x2028 || c == 0x2029 || c == 0x2581 || c == 0xFEFF ||
      c == 0xFFFD) {
    return U' ';
  }
  return c;
}

bool nmt_keep(char32_t c) {
  return !((c >= 0x01 && c <= 0x08) || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F ||
           c == 0x8F || c == 0x9F);
}

// Strip: leading / trailing White_Space characters.
// Strip: the numbers of White_Space characters at the start and at the end that `left` / `right`
// remove (all of them once, if the text is all white space).
std::pair<size_t, size_t> strip_counts(const std::string& text, bool left, bool right) {
  size_t lead = 0;
  size_t trail = 0;
  size_t chars = 0;
  bool in_lead = true;
  size_t run = 0;  // white space since the last other character
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    const bool ws = is_white_space(decode_utf8(text, pos, &len));
    pos += len;
    ++chars;
    if (in_lead && ws) {
      ++lead;
      continue;
    }
    in_lead = false;
    run = ws ? run + 1 : 0;
  }
  trail = run;
  if (in_lead) return {left ? lead : 0, left ? 0 : (right ? lead : 0)};
  return {left ? lead : 0, right ? trail : 0};
}

void strip_spaces(std::string& text, bool left, bool right) {
  size_t begin = 0;
  size_t end = text.size();
  if (left) {
    while (begin < end) {
      size_t len = 0;
      if (!is_white_space(decode_utf8(text, begin, &len))) break;
      begin += len;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      size_t len = 0;
      if (!is_white_space(decode_utf8(text, start, &len))) break;
      end = start;
    }
  }
  text = text.substr(begin, end - begin);
}

// Replaces each of `matches` (non-overlapping, in order) in `text` by `content`.
void replace_matches(std::string& text, const std::vector<std::pair<size_t, size_t>>& matches,
                     const std::string& content) {
  if (matches.empty()) return;
  std::string out;
  out.reserve(text.size());
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    out.append(text, prev, b - prev);
    out += content;
    prev = e;
  }
  out.append(text, prev, std::string::npos);
  text = std::move(out);
}

// Normalizer::normalize's `origin` after `matches` of `text` are replaced by `replacement`.
size_t replace_origin(const std::string& text,
                      const std::vector<std::pair<size_t, size_t>>& matches,
                      const std::string& replacement, size_t origin) {
  // HF's NormalizedString::replace: replacement text takes the offsets of the last character
  // it replaces, or of the one before an empty match (offset 0 at the very start, even when
  // the first character had moved).
  const size_t content = count_chars(replacement);
  size_t in = 0;   // characters of `text` passed
  size_t out = 0;  // leading characters of the result at offset 0
  size_t prev = 0;
  auto keep = [&](size_t n) {  // unmatched characters keep their offsets
    const size_t take = origin > in ? std::min(n, origin - in) : 0;
    out += take;
    in += n;
    return take == n;
  };
  for (const auto& [b, e] : matches) {
    if (!keep(count_chars(std::string_view(text).substr(prev, b - prev)))) return out;
    const size_t m = count_chars(std::string_view(text).substr(b, e - b));
    const bool at_origin = m > 0 ? in + m - 1 < origin : (in == 0 || in - 1 < origin);
    in += m;
    prev = e;
    if (content == 0) continue;
    if (!at_origin) return out;
    out += content;
  }
  keep(count_chars(std::string_view(text).substr(prev)));
  return out;
}

}  // namespace

void Normalizer::apply(const Step& s, std::string& text) {
  switch (s.kind) {
    case Step::Kind::kPrepend:
      // HF prepends only to non-empty text.
      if (!text.empty()) text.insert(0, s.content);
      break;
    case Step::Kind::kReplace: {
      std::vector<std::pair<size_t, size_t>> matches;
      s.pattern.find_all(text, matches);
      replace_matches(text, matches, s.content);
      break;
    }
    case Step::Kind::kUnicode:
      text = normalize_form(text, s.form);
      break;
    case Step::Kind::kLowercase:
      text = lowercase_chars(text);
      break;
    case Step::Kind::kStrip:
      strip_spaces(text, s.left, s.right);
      break;
    case Step::Kind::kStripAccents:
      text = filter_map(
          text, [](char32_t c) { return !is_mark(c); }, same);
      break;
    case Step::Kind::kBert:
      bert_normalize(text, s.clean_text, s.chinese_chars, s.strip_accents, s.lowercase);
      break;
    case Step::Kind::kNmt:
      text = filter_map(text, nmt_keep, nmt_space);
      break;
    case Step::Kind::kByteLevel: {
      const auto& chars = byte_level_chars();
      std::string mapped;
      mapped.reserve(text.size() * 2);
      for (const char c : text) mapped += chars[static_cast<unsigned char>(c)];
      text = std::move(mapped);
      break;
    }
  }
}

size_t Normalizer::origin_after(const Step& s, const std::string& text, size_t origin) {
  switch (s.kind) {
    case Step::Kind::kPrepend:
      // The prepended text shares the first character's offset.
      return text.empty() || origin == 0 ? origin : origin + count_chars(s.content);
    case Step::Kind::kStrip: {
      const auto [lead, trail] = strip_counts(text, s.left, s.right);
      const size_t n = count_chars(text);
      if (origin <= lead || lead + trail >= n) return 0;
      return std::min(origin - lead, n - lead - trail);
    }
    default: {
      // Every other step maps each character on its own (what it makes of one keeps its offset):
      // the leading characters at offset 0 become what the step makes of them.
      std::string prefix = text.substr(0, prefix_bytes(text, origin));
      apply(s, prefix);
      return count_chars(prefix);
    }
  }
}

void Normalizer::normalize(std::string& text, size_t* origin) const {
  // HF's offsets are the piece's start in the input plus its alignments: a piece that does not
  // begin the input never reaches offset 0.
  const bool begins_input = origin != nullptr && *origin > 0;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const Step& s : steps_) {
    // Once the start has moved, only text a Replace inserts at the very start (an empty match
    // there) is at offset 0 again.
    const bool track = begins_input && (*origin > 0 || s.kind == Step::Kind::kReplace);
    if (s.kind == Step::Kind::kReplace) {  // the matches serve both
      s.pattern.find_all(text, matches);
      if (track) *origin = replace_origin(text, matches, s.content, *origin);
      replace_matches(text, matches, s.content);
    } else {
      if (track) *origin = origin_after(s, text, *origin);
      apply(s, text);
    }
  }
}

}  // namespace ft::tokenizer
