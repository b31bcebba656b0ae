#include "tokenizer/pretokenizer.h"

#include <stdexcept>

#include "tokenizer/normalizer.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

namespace {

// GPT-2's pattern, built into HF's ByteLevel pre-tokenizer (use_regex = true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The Whitespace pre-tokenizer's Rust-regex pattern `\w+|[^\w\s]+` in PCRE2 terms: Rust's Unicode
// \w is Alphabetic, marks, decimal numbers, connector punctuation and the joiners; \s is
// White_Space.
constexpr const char* kRustWordsPattern =
    R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]+|)"
    R"([^\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}\p{White_Space}]+)";

}  // namespace

MetaspaceOptions MetaspaceOptions::parse(const Json& obj, const std::string& key,
                                         const JsonFields& f) {
  MetaspaceOptions m;
  m.replacement = f.character(obj, key, "replacement");
  m.split = f.boolean(obj, key, "split", true);
  if (const Json* scheme = f.optional(obj, "prepend_scheme")) {
    const std::string s = scheme->is_string() ? scheme->get<std::string>() : scheme->dump();
    if (s == "always") {
      m.scheme = PrependScheme::kAlways;
    } else if (s == "first") {
      m.scheme = PrependScheme::kFirst;
    } else if (s == "never") {
      m.scheme = PrependScheme::kNever;
    } else {
      f.fail(JsonFields::join(key, "prepend_scheme"),
             "expected \"always\", \"first\" or \"never\", got " + s);
    }
  }
  // tokenizers < 0.15 wrote add_prefix_space instead; HF still reads it and rejects a false
  // one that contradicts the (possibly defaulted) scheme.
  if (!f.boolean(obj, key, "add_prefix_space", true)) {
    if (m.scheme != PrependScheme::kNever) {
      f.fail(JsonFields::join(key, "add_prefix_space"),
             "add_prefix_space false does not match prepend_scheme (HF refuses this too)");
    }
  }
  return m;
}

PreTokenizer::PreTokenizer(const Json& pre_tokenizer, const std::string& key, const JsonFields& f) {
  parse(pre_tokenizer, key, f);
}

PreTokenizer::Behavior PreTokenizer::parse_behavior(const Json& p, const std::string& key,
                                                    const JsonFields& f, bool required) {
  // Punctuation's behavior defaults to Isolated (serde default); Split's is required.
  if (!required && f.optional(p, "behavior") == nullptr) return Behavior::kIsolated;
  const std::string behavior = f.string(p, key, "behavior");
  if (behavior == "Removed") return Behavior::kRemoved;
  if (behavior == "Isolated") return Behavior::kIsolated;
  if (behavior == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (behavior == "MergedWithNext") return Behavior::kMergedWithNext;
  if (behavior == "Contiguous") return Behavior::kContiguous;
  f.fail(JsonFields::join(key, "behavior"),
         "unknown split behavior \"" + behavior +
             "\" (expected Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous)");
}

void PreTokenizer::parse(const Json& p, const std::string& key, const JsonFields& f) {
  const std::string type = f.type_of(p, key);
  if (type == "Sequence") {
    const Json& list = f.array(p, key, "pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      parse(list[i], JsonFields::index(JsonFields::join(key, "pretokenizers"), i), f);
    }
    return;
  }
  Step step;
  auto char_split = [&](CharClass cls, Behavior behavior) {
    step.kind = Step::Kind::kCharSplit;
    step.char_class = cls;
    step.behavior = behavior;
  };
  if (type == "Split") {
    step.kind = Step::Kind::kSplit;
    step.pattern = TextPattern::parse(p, key, "pattern", f);
    step.behavior = parse_behavior(p, key, f, true);
    step.invert = f.boolean(p, key, "invert", false);
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::kByteLevel;
    step.add_prefix_space = f.boolean(p, key, "add_prefix_space", true);
    step.use_regex = f.boolean(p, key, "use_regex", true);
    if (step.use_regex && !gpt2_regex_) gpt2_regex_ = Regex::oniguruma(kGpt2Pattern);
  } else if (type == "Metaspace") {
    step.kind = Step::Kind::kMetaspace;
    step.metaspace = MetaspaceOptions::parse(p, key, f);
  } else if (type == "Digits") {
    // Contiguous keeps a run of digits together; individual_digits isolates each one.
    char_split(CharClass::kNumeric, f.boolean(p, key, "individual_digits", false)
                                        ? Behavior::kIsolated
                                        : Behavior::kContiguous);
  } else if (type == "Punctuation") {
    char_split(CharClass::kPunctuation, parse_behavior(p, key, f, false));
  } else if (type == "WhitespaceSplit") {
    char_split(CharClass::kWhiteSpace, Behavior::kRemoved);
  } else if (type == "CharDelimiterSplit") {
    char_split(CharClass::kDelimiter, Behavior::kRemoved);
    const std::string d = f.character(p, key, "delimiter");
    size_t len = 0;
    step.delimiter = decode_utf8(d, 0, &len);
  } else if (type == "Whitespace") {
    // HF: Rust regex `\w+|[^\w\s]+`, the gaps removed (a Split with invert).
    step.kind = Step::Kind::kSplit;
    step.pattern.regex = Regex::pcre2(kRustWordsPattern);
    step.behavior = Behavior::kRemoved;
    step.invert = true;
  } else if (type == "BertPreTokenizer") {
    // Two passes: white space removed, then every punctuation character isolated.
    char_split(CharClass::kWhiteSpace, Behavior::kRemoved);
    steps_.push_back(step);
    char_split(CharClass::kPunctuation, Behavior::kIsolated);
  } else if (type == "UnicodeScripts") {
    step.kind = Step::Kind::kScripts;
  } else {
    f.unsupported(key, "pre_tokenizer", type,
                  "Sequence, Split, ByteLevel, Metaspace, Digits, Punctuation, Whitespace, "
                  "WhitespaceSplit, CharDelimiterSplit, UnicodeScripts, BertPreTokenizer");
  }
  steps_.push_back(std::move(step));
}

void PreTokenizer::char_matches(const Step& step, const std::string& text,
                                std::vector<std::pair<size_t, size_t>>& matches) {
  // HF's Pattern for Fn(char) -> bool: every matching character is a match of its own.
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    const char32_t cp = decode_utf8(text, pos, &len);
    bool hit = false;
    switch (step.char_class) {
      case CharClass::kWhiteSpace:
        hit = is_white_space(cp);
        break;
      case CharClass::kNumeric:
        hit = is_numeric(cp);
        break;
      case CharClass::kPunctuation:
        hit = is_punctuation(cp);
        break;
      case CharClass::kDelimiter:
        hit = cp == step.delimiter;
        break;
    }
    if (hit) matches.emplace_back(pos, pos + len);
    pos += len;
  }
}

void PreTokenizer::script_split(const Piece& piece, std::vector<Piece>& out) {
  // HF's UnicodeScripts: a cut before each character whose script differs from the last
  // non-"Any" one. The first cut is only made at a character that is not "Any", so leading
  // spaces are dropped (as HF does: its slices start at the first cut).
  const std::string& text = piece.text;
  std::vector<size_t> cuts;
  int last = kAnyScript;
  bool have_last = false;
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    const int script = hf_script(decode_utf8(text, pos, &len));
    if (script != kAnyScript) {
      if (!have_last || last != script) cuts.push_back(pos);
      last = script;
      have_last = true;
    }
    pos += len;
  }
  cuts.push_back(text.size());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (cuts[i] == cuts[i + 1]) continue;
    out.push_back(
        Piece{text.substr(cuts[i], cuts[i + 1] - cuts[i]), -1, piece.origin_from(cuts[i])});
  }
}

void PreTokenizer::split(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                         Behavior behavior, bool invert, std::vector<Piece>& out) {
  // The whole text as (begin, end, is_match) spans, as HF's Pattern::find_matches gives them.
  struct Span {
    size_t begin;
    size_t end;
    bool match;
  };
  std::vector<Span> spans;
  spans.reserve(2 * matches.size() + 1);
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  }
  if (prev != piece.text.size()) spans.push_back({prev, piece.text.size(), invert});

  // Then NormalizedString::split's behaviors; `remove` marks what Removed drops.
  struct Out {
    size_t begin;
    size_t end;
    bool remove;
  };
  std::vector<Out> parts;
  parts.reserve(spans.size());
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Span& s : spans) parts.push_back({s.begin, s.end, false});
      break;
    case Behavior::kRemoved:
      for (const Span& s : spans) parts.push_back({s.begin, s.end, s.match});
      break;
    case Behavior::kContiguous: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.match == previous && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.begin, s.end, false});
        }
        previous = s.match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous = false;
      for (const Span& s : spans) {
        if (s.match && !previous && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.begin, s.end, false});
        }
        previous = s.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous && !parts.empty()) {
          parts.back().begin = it->begin;
        } else {
          parts.push_back({it->begin, it->end, false});
        }
        previous = it->match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
  }
  for (const Out& o : parts) {
    if (o.remove || o.begin == o.end) continue;
    out.push_back(
        Piece{piece.text.substr(o.begin, o.end - o.begin), -1, piece.origin_from(o.begin)});
  }
}

void PreTokenizer::apply(const Step& step, const Piece& piece, std::vector<Piece>& out) const {
  std::vector<std::pair<size_t, size_t>> matches;
  switch (step.kind) {
    case Step::Kind::kSplit:
      step.pattern.find_all(piece.text, matches);
      split(piece, matches, step.behavior, step.invert, out);
      return;

    case Step::Kind::kCharSplit:
      char_matches(step, piece.text, matches);
      split(piece, matches, step.behavior, false, out);
      return;

    case Step::Kind::kScripts:
      script_split(piece, out);
      return;

    case Step::Kind::kByteLevel: {
      Piece p = piece;
      // HF adds the space to every piece, not only the first one.
      if (step.add_prefix_space && (p.text.empty() || p.text[0] != ' ')) {
        p.text.insert(0, " ");
        if (p.at_origin()) ++p.origin_chars;
      }
      std::vector<Piece> words;
      if (step.use_regex) {
        gpt2_regex_->find_all(p.text, matches);
        split(p, matches, Behavior::kIsolated, false, words);
      } else if (!p.text.empty()) {
        words.push_back(std::move(p));
      }
      const auto& chars = byte_level_chars();
      for (Piece& w : words) {
        std::string mapped;
        mapped.reserve(w.text.size() * 2);
        for (const char c : w.text) mapped += chars[static_cast<unsigned char>(c)];
        // Each byte becomes a character with the offset of the character it came from.
        w.origin_chars = prefix_bytes(w.text, w.origin_chars);
        w.text = std::move(mapped);
        out.push_back(std::move(w));
      }
      return;
    }

    case Step::Kind::kMetaspace: {
      const MetaspaceOptions& m = step.metaspace;
      Piece p{replace_all(piece.text, " ", m.replacement), -1, piece.origin_chars};
      const bool starts = p.text.compare(0, m.replacement.size(), m.replacement) == 0;
      // "first" prepends only to a piece that begins at offset 0 of the input, so text after a
      // special token gets no "▁" (the non-legacy Llama / Mistral behaviour). The "▁" shares the
      // first character's offset.
      if (!starts && (m.scheme == PrependScheme::kAlways ||
                      (m.scheme == PrependScheme::kFirst && p.at_origin()))) {
        p.text.insert(0, m.replacement);
        if (p.at_origin()) ++p.origin_chars;
      }
      if (!m.split) {
        if (!p.text.empty()) out.push_back(std::move(p));
        return;
      }
      for (size_t hit = p.text.find(m.replacement); hit != std::string::npos;
           hit = p.text.find(m.replacement, hit + m.replacement.size())) {
        matches.emplace_back(hit, hit + m.replacement.size());
      }
      split(p, matches, Behavior::kMergedWithNext, false, out);
      return;
    }
  }
}

void PreTokenizer::pre_tokenize(std::vector<Piece>& pieces) const {
  std::vector<Piece> next;
  for (const Step& step : steps_) {
    next.clear();
    next.reserve(pieces.size() * 2);
    for (Piece& p : pieces) {
      if (p.is_token()) {
        next.push_back(std::move(p));
      } else {
        apply(step, p, next);
      }
    }
    pieces.swap(next);
  }
}

}  // namespace ft::tokenizer
