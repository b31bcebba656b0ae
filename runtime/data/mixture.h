// A weighted mixture of JSONL sources as one stream of training batches (data.sources, or --data
// PATH:WEIGHT given once per source), and the held-out split of the training data (eval.split).
// The mixture owns its sources; not thread-safe (a source is read by one loop).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/settings.h"
#include "data/batch.h"
#include "data/jsonl_source.h"
#include "data/packer.h"

namespace ft::data {

// One training source as the user gave it, and where, for errors: "data.sources[1]" or
// "--data 'b.jsonl:0.3'".
struct SourceSpec {
  config::DataSourceSettings settings;
  std::string origin;
  config::RecordShapeSettings shape;  // data.columns.* / data.tags.* / data.tools, before the
                                      // entry's own (settings.shape) replace some of them
};

// One --data value: PATH, or PATH:WEIGHT when the text after the last ':' is a number (so a path
// that holds ':' itself is still a path). ConfigError for a weight <= 0, or not finite.
SourceSpec parse_data_arg(const std::string& arg);

// The sources of a run: --data's values (`data_args`), else data.sources; their names filled in
// (the file name when not given). ConfigError when both are given, or two sources share a name.
// Empty when neither is (the synthetic task).
std::vector<SourceSpec> training_sources(const config::DataSettings& data,
                                         const std::vector<std::string>& data_args);

// Each spec opened as a JsonlSource: `base` with the spec's path, format, template,
// max_records and record shape (empty format / template: base's). ConfigError naming the spec's
// origin for a file that does not exist.
std::vector<std::unique_ptr<JsonlSource>> open_sources(const std::vector<SourceSpec>& specs,
                                                       const JsonlOptions& base);

// eval.split over the sources: a fraction (< 1) of each source's used records, rounded up, or a
// whole count (>= 1) spread over them in proportion to their sizes (largest remainders); set
// aside with JsonlSource::hold_out, salted by each source's name. ConfigError for a count that is
// not whole, or that leaves a source nothing to train on.
void hold_out_split(const std::vector<SourceSpec>& specs,
                    const std::vector<std::unique_ptr<JsonlSource>>& sources, double split);

// The global record stream g = 0, 1, 2, ...: record g comes from source k with probability
// weight_k / sum(weights), drawn from (seed, g) alone; it is that source's n-th draw (n: the
// earlier g from the same source), i.e. position n % N_k of the source's epoch n / N_k order
// (N_k its train_records(); each source is reshuffled on its own when it runs out). Rank r of W
// takes g = r, r+W, ... and packs them as one file's records are packed. Every rank follows every
// draw (a hash per record) and reads only its own records. An epoch of the mixture is
// sum(N_k) draws; train.epochs counts those.
class MixtureSource : public BatchSource {
 public:
  struct Options {
    std::vector<std::string> names;  // per source, for metrics
    std::vector<double> weights;     // per source, > 0
    PackOptions pack;
    uint64_t seed = JsonlOptions::kDefaultSeed;
    int rank = 0, world_size = 1;
  };
  MixtureSource(std::vector<std::unique_ptr<JsonlSource>> sources, Options options);

  Batch next() override;
  // The global draws before this rank's next one, rounded down to a multiple of world_size.
  int64_t samples_consumed() const override;
  // {samples_consumed(), then each source's draws before it}: world-size independent, and what
  // seek() continues from without replaying the stream.
  std::vector<int64_t> position() const override;
  void seek(const std::vector<int64_t>& position) override;

  size_t size() const { return sources_.size(); }
  JsonlSource& source(size_t k) { return *sources_[k]; }
  const std::string& name(size_t k) const { return options_.names[k]; }
  double share(size_t k) const;  // weight over the sum of the weights
  // The source of global record g: a function of (seed, g) only.
  size_t source_of(int64_t g) const;
  // sum over sources of train_records(): the draws one epoch of the mixture takes.
  int64_t epoch_records() const { return epoch_records_; }
  // This rank's records and tokens (input tokens, cut to seq_len) placed in batches so far, per
  // source (since construction; a seek does not reset them).
  const std::vector<int64_t>& records_placed() const { return records_placed_; }
  const std::vector<int64_t>& tokens_placed() const { return tokens_placed_; }
  // The rows of the first epoch_records() draws, packed as next() packs them: every source's
  // records tokenized once (scan_epoch; `progress(done, total)` over all of them). Leaves the
  // stream's position unchanged.
  int64_t rows_per_epoch(const std::function<void(int64_t, int64_t)>& progress = {});

 private:
  TokenizedRecord next_record();
  // counts_ and next_global_ past the draws [next_global_, end).
  void advance_to(int64_t end);
  int64_t cursor() const { return has_pending_ ? pending_global_ : next_global_; }

  std::vector<std::unique_ptr<JsonlSource>> sources_;
  Options options_;
  std::vector<double> cumulative_;  // shares' running sums; the last is 1
  int64_t epoch_records_ = 0;
  int64_t next_global_ = 0;      // this rank's next draw (== rank mod world_size)
  std::vector<int64_t> counts_;  // each source's draws before next_global_
  bool has_pending_ = false;     // a record that did not fit the previous row
  TokenizedRecord pending_;
  int64_t pending_global_ = 0;
  size_t pending_source_ = 0;
  std::vector<int64_t> pending_counts_;  // counts_ before the pending record's draw
  std::vector<int64_t> records_placed_, tokens_placed_;
};

}  // namespace ft::data
