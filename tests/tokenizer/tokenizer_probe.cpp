// What one normalizer or pre-tokenizer of ft makes of a text, for make_component_fixtures.py
// --unicode, which compares it with HF over every assigned code point:
//   tokenizer_probe COMPONENT_JSON TEXT_FILE
// COMPONENT_JSON holds {"normalizer": {...}} or {"pre_tokenizer": {...}}; prints the normalized
// text as a JSON string, or the pre-tokenizer's words as a JSON array.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"

using namespace ft::tokenizer;

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s COMPONENT_JSON TEXT_FILE\n", argv[0]);
    return 2;
  }
  std::ifstream component_file(argv[1]);
  const Json component = Json::parse(component_file);
  std::ifstream text_file(argv[2], std::ios::binary);
  std::stringstream text;
  text << text_file.rdbuf();
  const JsonFields fields(argv[1]);
  Json out;
  if (component.contains("normalizer")) {
    std::string normalized = text.str();
    Normalizer(component["normalizer"], "normalizer", fields).normalize(normalized);
    out = normalized;
  } else {
    std::vector<Piece> pieces{Piece{text.str(), -1, 1}};
    PreTokenizer(component["pre_tokenizer"], "pre_tokenizer", fields).pre_tokenize(pieces);
    out = Json::array();
    for (const Piece& p : pieces) out.push_back(p.text);
  }
  std::cout << out.dump() << "\n";
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
