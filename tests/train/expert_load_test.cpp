// A MoE model's expert-load record and the collapse warning's logic (train/expert_load.h), on
// hand-made counts.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/expert_load.h"

using nlohmann::json;

TEST_CASE("expert load per layer: most, mean, least", "[unit]") {
  // Two layers (model layers 1 and 3) of 4 experts.
  const std::vector<int64_t> tokens = {5, 0, 3, 8, 4, 4, 4, 4};
  const auto loads = ft::train::layer_loads(tokens, {1, 3});
  REQUIRE(loads.size() == 2);
  CHECK(loads[0].layer == 1);
  CHECK(loads[0].max == 8);
  CHECK(loads[0].most == 3);
  CHECK(loads[0].min == 0);
  CHECK(loads[0].least == 1);
  CHECK(loads[0].mean == 4.0);
  CHECK(loads[0].imbalance() == 2.0);
  CHECK(loads[1].imbalance() == 1.0);
  const json rec = ft::train::moe_record(1.5, tokens, {1, 3});
  CHECK(rec["expert_tokens"][1] == json({4, 4, 4, 4}));
  CHECK(rec["layers"][0]["most"] == 3);
  CHECK(rec["aux_loss"] == 1.5);
}

TEST_CASE("an expert without tokens for moe.collapse_steps steps is named once", "[unit]") {
  ft::train::ExpertWatch watch(3);
  const std::vector<int64_t> layers = {0, 2};
  const std::vector<int64_t> fine = {2, 2, 2, 2, 2, 2}, idle = {2, 2, 2, 3, 0, 3};
  CHECK(watch.observe(1, idle, layers, 0.01).empty());
  CHECK(watch.observe(2, idle, layers, 0.01).empty());
  CHECK(watch.observe(3, fine, layers, 0.01).empty());  // a token again: the count restarts
  CHECK(watch.observe(4, idle, layers, 0.01).empty());
  CHECK(watch.observe(5, idle, layers, 0.01).empty());
  const std::string w = watch.observe(6, idle, layers, 0.01);
  CHECK_THAT(w, Catch::Contains("expert 1 of layer 2") && Catch::Contains("for 3 steps") &&
                    Catch::Contains("moe.aux_loss_coef (now 0.01)"));
  CHECK(watch.observe(7, idle, layers, 0.01).empty());  // once per run
  ft::train::ExpertWatch off(1);
  CHECK_THAT(off.observe(1, idle, layers, 0), Catch::Contains("moe.aux_loss=on"));
}
