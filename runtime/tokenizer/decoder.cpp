#include "tokenizer/decoder.h"

#include "tokenizer/normalizer.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

Decoder::Decoder(const Json& decoder, const std::string& key, const JsonFields& f) {
  parse(decoder, key, f);
}

void Decoder::parse(const Json& d, const std::string& key, const JsonFields& f) {
  const std::string type = f.type_of(d, key);
  Step step;
  if (type == "Sequence") {
    const Json& list = f.array(d, key, "decoders");
    for (size_t i = 0; i < list.size(); ++i) {
      parse(list[i], JsonFields::index(JsonFields::join(key, "decoders"), i), f);
    }
    return;
  } else if (type == "Replace") {
    step.kind = Step::Kind::kReplace;
    const Json& pattern = f.object(d, key, "pattern");
    const std::string pkey = JsonFields::join(key, "pattern");
    if (f.optional(pattern, "String") == nullptr) {
      f.fail(pkey,
             "only {\"String\": ...} patterns are supported for Replace, got " + pattern.dump());
    }
    step.pattern = f.string(pattern, pkey, "String");
    if (step.pattern.empty()) f.fail(JsonFields::join(pkey, "String"), "empty pattern");
    step.content = f.string(d, key, "content");
  } else if (type == "ByteFallback") {
    step.kind = Step::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = Step::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = Step::Kind::kStrip;
    step.pattern = f.character(d, key, "content");
    const int64_t start = f.integer(d, key, "start");
    const int64_t stop = f.integer(d, key, "stop");
    if (start < 0 || stop < 0) f.fail(key, "Strip start and stop must be >= 0");
    step.start = static_cast<size_t>(start);
    step.stop = static_cast<size_t>(stop);
  } else if (type == "Metaspace") {
    step.kind = Step::Kind::kMetaspace;
    step.metaspace = MetaspaceOptions::parse(d, key, f);
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::kByteLevel;
  } else {
    f.unsupported(key, "decoder", type,
                  "Sequence, Replace, ByteFallback, Fuse, Strip, "
                  "Metaspace, ByteLevel");
  }
  steps_.push_back(std::move(step));
}

namespace {

// "<0xNN>" -> NN, or -1 (HF: six bytes, "<0x" prefix, ">" suffix, two hex digits).
int byte_token_value(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]);
  const int lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

std::vector<std::string> byte_fallback(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  out.reserve(tokens.size());
  std::string bytes;
  // A run of byte tokens becomes its text if it is valid UTF-8 as a whole, else one U+FFFD per
  // byte (not per invalid sequence: that is HF's rule here, unlike from_utf8_lossy).
  auto flush = [&] {
    if (bytes.empty()) return;
    if (find_invalid_utf8(bytes) == std::string::npos) {
      out.push_back(bytes);
    } else {
      for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
    }
    bytes.clear();
  };
  for (std::string& t : tokens) {
    const int b = byte_token_value(t);
    if (b >= 0) {
      bytes += static_cast<char>(b);
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

std::string strip(const std::string& token, const std::string& ch, size_t start, size_t stop) {
  // Counted in characters, as HF does on its Vec<char>.
  std::vector<size_t> offsets;  // byte offset of each character
  for (size_t pos = 0; pos < token.size();
       pos += utf8_len(static_cast<unsigned char>(token[pos]))) {
    offsets.push_back(pos);
  }
  auto char_at = [&](size_t i) {
    const size_t end = i + 1 < offsets.size() ? offsets[i + 1] : token.size();
    return std::string_view(token).substr(offsets[i], end - offsets[i]);
  };
  size_t start_cut = 0;
  for (size_t i = 0; i < start && i < offsets.size(); ++i) {
    if (char_at(i) != ch) break;
    start_cut = i + 1;
  }
  size_t stop_cut = offsets.size();
  for (size_t i = 0; i < stop && i < offsets.size(); ++i) {
    const size_t index = offsets.size() - i - 1;
    if (char_at(index) != ch) break;
    stop_cut = index;
  }
  if (start_cut >= stop_cut) return {};
  const size_t b = offsets[start_cut];
  const size_t e = stop_cut < offsets.size() ? offsets[stop_cut] : token.size();
  return token.substr(b, e - b);
}

}  // namespace

std::string Decoder::decode(std::vector<std::string> tokens) const {
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::Kind::kReplace:
        for (std::string& t : tokens) t = replace_all(t, s.pattern, s.content);
        break;
      case Step::Kind::kByteFallback:
        tokens = byte_fallback(std::move(tokens));
        break;
      case Step::Kind::kFuse: {
        std::string joined;
        for (const std::string& t : tokens) joined += t;
        tokens.assign(1, std::move(joined));
        break;
      }
      case Step::Kind::kStrip:
        for (std::string& t : tokens) t = strip(t, s.pattern, s.start, s.stop);
        break;
      case Step::Kind::kMetaspace:
        // Every replacement character becomes a space, except in the first token, where HF
        // drops them all (unless the scheme is "never").
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && s.metaspace.scheme != PrependScheme::kNever;
          tokens[i] = replace_all(tokens[i], s.metaspace.replacement, drop ? "" : " ");
        }
        break;
      case Step::Kind::kByteLevel: {
        // Each token maps back to bytes character by character; a token with a character outside
        // the table contributes its UTF-8 as is. The bytes are then decoded lossily, as a whole.
        std::string bytes;
        for (const std::string& t : tokens) {
          std::string mapped;
          bool ok = true;
          for (size_t pos = 0; pos < t.size() && ok;) {
            size_t len = 0;
            const int b = byte_level_byte(decode_utf8(t, pos, &len));
            ok = b >= 0;
            mapped += static_cast<char>(b);
            pos += len;
          }
          bytes += ok ? mapped : t;
        }
        tokens.assign(1, utf8_lossy(bytes));
        break;
      }
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace ft::tokenizer
