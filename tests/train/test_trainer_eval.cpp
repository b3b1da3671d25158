// End-to-end tests of `fsdp-train eval` and eval.interval, of SentencePiece tokens (`tokenize
// --tokenizer`, data.tokenizer's sample), of tools/pretokenize.py and of llm.c's token files:
// the real program, started directly or by fsdprun, with real ranks on loopback.
#include "config/config.h"
#include "process_harness.h"
#include "trainer_runs.h"

#include "../python_path.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

using namespace process_test;
using namespace trainer_test;

namespace {

// The value of the `eval loss: <value>` line; NaN when there is none.
double eval_loss_of(const RunResult& r) {
  std::smatch m;
  if (!std::regex_search(r.out, m, std::regex("(^|\n|\\]:)eval loss: (\\S+)"))) return NAN;
  return std::stod(m[2]);
}

// A text of `bytes` bytes that a small model learns something from: English-like lines.
std::string text_of(size_t bytes) {
  const std::vector<std::string> words = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and"};
  std::string text;
  for (size_t i = 0; text.size() < bytes; ++i) text += words[(i * 7 + i / 3) % words.size()] + (i % 11 ? " " : "\n");
  return text.substr(0, bytes);
}

// A byte-level token file of `bytes` bytes of text under dir.
std::string byte_tokens(const TempDir& dir, size_t bytes) {
  std::ofstream(dir / "text.txt") << text_of(bytes);
  RunResult tok = trainer.run({"tokenize", dir / "text.txt", dir / "text.tokens"}, {}, 30);
  EXPECT_EQ(tok.exit_code, 0) << describe(tok);
  return dir / "text.tokens";
}

// base_args with the byte-level vocabulary and eval.path.
std::vector<std::string> eval_args(const TempDir& dir, const std::string& tokens, int steps) {
  return with(base_args(dir.path(), steps),
              {"--model.vocab_size=256", "--data.source=tokens", "--data.path=" + tokens, "--eval.path=" + tokens});
}

void write_llmc(const std::string& path, const std::vector<uint16_t>& ids) {
  std::string out;
  auto put32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put32(20240520), put32(1), put32(static_cast<uint32_t>(ids.size()));
  out.resize(1024, '\0');
  for (uint16_t id : ids) out.push_back(static_cast<char>(id & 0xff)), out.push_back(static_cast<char>(id >> 8));
  std::ofstream(path, std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size()));
}

bool have_spm_train() { return std::system("command -v spm_train >/dev/null 2>&1") == 0; }

// ------------------------------------------------------------------ fsdp-train eval

// The same windows give the same loss at W=1 (4 rows per batch) and W=2 (2 rows per rank), and
// the loss is the one PyTorch computes over the exported model (bench/peer/model.py's
// Transformer, the same model) on the first windows of the file.
TEST(TrainerEval, SameLossAtOneAndTwoRanksAndAsPyTorchComputesIt) {
  FSDP_SKIP_WITHOUT_PYTHON();
  TempDir dir;
  const std::string tokens = byte_tokens(dir, 20000);
  const auto train = with(eval_args(dir, tokens, 3), {"--training.export=" + dir / "model.pt"});
  RunResult t = fsdprun.run(under_fsdprun(2, train), {}, 120);
  ASSERT_EQ(t.exit_code, 0) << describe(t);

  const auto eval = with(eval_args(dir, tokens, 3), {"--eval.batches=3"});
  RunResult one = trainer.run(with({"eval"}, with(eval, {"--training.micro_batch_size=4"})), {}, 120);
  ASSERT_EQ(one.exit_code, 0) << describe(one);
  EXPECT_TRUE(contains(one, "eval: weights: the checkpoint " + dir / "ckpt/step_3")) << describe(one);
  EXPECT_TRUE(contains(one, "3 batch(es) x 4 windows of 65 tokens")) << describe(one);
  std::vector<std::string> two_args = {"eval"};
  two_args = with(two_args, with(eval, {"--training.micro_batch_size=2"}));
  RunResult two = fsdprun.run(under_fsdprun(2, two_args), {}, 120);
  ASSERT_EQ(two.exit_code, 0) << describe(two);

  const double w1 = eval_loss_of(one), w2 = eval_loss_of(two);
  ASSERT_TRUE(std::isfinite(w1) && std::isfinite(w2)) << describe(one) << describe(two);
  EXPECT_NEAR(w1, w2, 1e-6 * w1);

  const Program python(FSDP_TEST_PYTHON);
  RunResult ref = python.run({std::string(FSDP_TRAIN_SOURCE_DIR) + "/eval_reference.py", FSDP_PEER_MODEL_DIR,
                              dir / "model.pt", tokens, "2", "64", "4", "256", "64", "64", "12"},
                             {}, 120);
  ASSERT_EQ(ref.exit_code, 0) << describe(ref);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(ref.out, m, std::regex("reference eval loss: (\\S+)"))) << describe(ref);
  EXPECT_NEAR(w1, std::stod(m[1]), 1e-5 * w1) << "fsdp-train eval " << w1 << ", PyTorch " << m[1];
}

// eval.interval: the eval loss is in the step lines and the JSONL of the steps it names, the
// last one is what `fsdp-train eval` gives for the final checkpoint, and evaluating changes
// nothing of training: the losses are bitwise those of a run without it (dropout on, so the
// random stream would show an evaluation that drew from it).
TEST(TrainerEval, IntervalLogsTheEvalLossInTheStepLineAndTheJsonl) {
  TempDir dir;
  const std::string tokens = byte_tokens(dir, 20000);
  const auto train = with(eval_args(dir, tokens, 4), {"--eval.interval=3", "--eval.batches=2", "--model.dropout_p=0.1",
                                                      "--logging.tensorboard_dir=" + dir / "tb"});
  RunResult t = fsdprun.run(under_fsdprun(2, train), {}, 120);
  ASSERT_EQ(t.exit_code, 0) << describe(t);
  EXPECT_TRUE(std::regex_search(t.out, std::regex("step: 3  loss: \\S+  eval loss: \\S+"))) << describe(t);
  EXPECT_TRUE(std::regex_search(t.out, std::regex("step: 4  loss: \\S+  eval loss: \\S+"))) << describe(t);
  std::map<int64_t, double> logged;
  std::ifstream in(dir / "m1.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("eval_loss")) logged[j.at("step").get<int64_t>()] = j.at("eval_loss").get<double>();
  }
  ASSERT_EQ(logged.size(), 2u) << "steps 3 (the interval) and 4 (the last)";
  ASSERT_TRUE(logged.count(3) && logged.count(4));
  // TensorBoard's eval/loss has the same steps and values (as 32-bit floats, TensorBoard's).
  if (!std::string(FSDP_TEST_PYTHON).empty()) {
    const Program python(FSDP_TEST_PYTHON);
    const std::string read_scalars =
        "import sys\n"
        "from tensorboard.backend.event_processing import event_accumulator as ea\n"
        "acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})\n"
        "acc.Reload()\n"
        "for e in acc.Scalars('eval/loss'): print('eval/loss', e.step, repr(e.value))\n";
    RunResult tb = python.run({"-c", read_scalars, dir / "tb"}, {}, 120);
    if (tb.exit_code == 0) {
      for (const auto& [step, loss] : logged) {
        const std::string line = "eval/loss " + std::to_string(step) + " ";
        const size_t at = tb.out.find(line);
        ASSERT_NE(at, std::string::npos) << describe(tb);
        EXPECT_EQ(std::stof(tb.out.substr(at + line.size())), static_cast<float>(loss)) << describe(tb);
      }
    } else {
      EXPECT_TRUE(contains(tb, "No module named 'tensorboard'")) << describe(tb);  // the package only is missing
    }
  }
  TempDir plain;
  RunResult p = fsdprun.run(under_fsdprun(2, with(eval_args(plain, tokens, 4), {"--model.dropout_p=0.1"})), {}, 120);
  ASSERT_EQ(p.exit_code, 0) << describe(p);
  const auto with_eval = read_metrics(dir / "m0.jsonl"), without = read_metrics(plain / "m0.jsonl");
  ASSERT_EQ(with_eval.size(), 4u);
  ASSERT_EQ(without.size(), 4u);
  for (const auto& [step, m] : without) EXPECT_EQ(with_eval.at(step).loss, m.loss) << "step " << step;

  RunResult e =
      fsdprun.run(under_fsdprun(2, with({"eval"}, with(eval_args(dir, tokens, 4), {"--eval.batches=2"}))), {}, 120);
  ASSERT_EQ(e.exit_code, 0) << describe(e);
  EXPECT_NEAR(eval_loss_of(e), logged.at(4), 1e-6 * logged.at(4)) << describe(e);
}

TEST(TrainerEval, WithoutACheckpointSaysItEvaluatesTheSeededInitialisation) {
  TempDir dir;
  const std::string tokens = byte_tokens(dir, 5000);
  RunResult r = trainer.run(with({"eval"}, eval_args(dir, tokens, 1)), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, "eval: weights: the seeded initialisation (training.seed 0)")) << describe(r);
  // About ln(256) for an untrained model over 256 ids.
  EXPECT_NEAR(eval_loss_of(r), std::log(256.0), 0.5) << describe(r);
}

struct BadEval {
  std::string name;
  std::vector<std::string> args;  // after eval_args
  std::vector<std::string> expected;
};

TEST(TrainerEval, BadConfigurationStopsNamingTheKey) {
  TempDir dir;
  const std::string tokens = byte_tokens(dir, 5000);
  const std::vector<BadEval> cases = {
      {"no eval.path", {"--eval.path="}, {"eval.path: required"}},
      {"too many batches",
       {"--eval.batches=100"},
       {"eval.batches: 100 global batches of 4 windows", "need 26000 tokens", "has 5000"}},
      {"ids beyond the vocabulary",
       {"--model.vocab_size=64"},
       {"text.tokens: token 0 is id ", "model.vocab_size (64)"}},
      {"interval without a path", {"--eval.path=", "--eval.interval=2"}, {"eval.path: required when eval.interval"}},
  };
  for (const BadEval& c : cases) {
    auto args = with(eval_args(dir, tokens, 1), {"--data.source=synthetic"});
    args = with(args, c.args);
    RunResult r = trainer.run(with({"eval"}, args), {}, 60);
    EXPECT_EQ(r.exit_code, 2) << c.name << "\n" << describe(r);
    for (const std::string& e : c.expected) EXPECT_TRUE(contains(r, e)) << c.name << ": " << e << "\n" << describe(r);
  }
}

// ------------------------------------------------------------------ llm.c token files

TEST(TrainerEval, TrainsAndEvaluatesFromAnLlmcBinFile) {
  TempDir dir;
  std::vector<uint16_t> ids;
  for (int i = 0; i < 6000; ++i) ids.push_back(static_cast<uint16_t>((i * 7 + i / 5) % 60));
  write_llmc(dir / "train.bin", ids);
  const auto args = with(base_args(dir.path(), 5), {"--data.source=tokens", "--data.path=" + dir / "train.bin",
                                                    "--eval.path=" + dir / "train.bin", "--eval.interval=5"});
  RunResult t = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(t.exit_code, 0) << describe(t);
  EXPECT_TRUE(contains(t, "llm.c token file " + dir / "train.bin" + " (6000 tokens")) << describe(t);
  RunResult e = fsdprun.run(under_fsdprun(2, with({"eval"}, args)), {}, 120);
  ASSERT_EQ(e.exit_code, 0) << describe(e);
  EXPECT_TRUE(std::isfinite(eval_loss_of(e))) << describe(e);
  EXPECT_LT(eval_loss_of(e), std::log(64.0)) << "trained on the same ids: below an untrained model's";

  // An id the model cannot embed stops the run naming the file and the id.
  ids[4321] = 64;
  write_llmc(dir / "bad.bin", ids);
  RunResult bad =
      trainer.run(with(base_args(dir / "b", 1), {"--data.source=tokens", "--data.path=" + dir / "bad.bin"}), {}, 60);
  EXPECT_EQ(bad.exit_code, 2) << describe(bad);
  EXPECT_TRUE(contains(bad, dir / "bad.bin" + ": token 4321 is id 64, not below model.vocab_size (64)"))
      << describe(bad);
}

// ------------------------------------------------------------------ SentencePiece

// A SentencePiece model trained here by Debian's spm_train; tokenize --tokenizer records its
// vocabulary; training on the tokens prints a sample decoded with data.tokenizer.
TEST(TrainerEval, TokenizeWithASentencePieceModelTrainAndDecodeTheSample) {
  if (!fsdp::train::built_with_sentencepiece()) {
    // A build without it refuses both by name and build option, before reading any file.
    TempDir dir;
    RunResult tok =
        trainer.run({"tokenize", "--tokenizer", dir / "m.model", dir / "in.txt", dir / "out.tokens"}, {}, 30);
    EXPECT_NE(tok.exit_code, 0);
    EXPECT_TRUE(contains(tok, "--tokenizer: " + dir / "m.model" + " needs SentencePiece")) << describe(tok);
    EXPECT_TRUE(contains(tok, "FSDP_WITH_SENTENCEPIECE")) << describe(tok);
    RunResult key = trainer.run(with(base_args(dir.path(), 10), {"--data.tokenizer=" + dir / "m.model"}), {}, 30);
    EXPECT_EQ(key.exit_code, 2) << describe(key);
    EXPECT_TRUE(contains(key, "data.tokenizer: " + dir / "m.model" + " needs SentencePiece")) << describe(key);
    GTEST_SKIP() << "this build has no SentencePiece (FSDP_WITH_SENTENCEPIECE): its refusal was checked instead";
  }
  if (!have_spm_train())
    GTEST_SKIP() << "spm_train (Debian's sentencepiece package, scripts/install-deps.sh) is not installed";
  TempDir dir;
  std::ofstream(dir / "text.txt") << text_of(20000);
  ASSERT_EQ(std::system(("spm_train --input=" + dir / "text.txt" + " --model_prefix=" + dir / "spm" +
                         " --vocab_size=40 --model_type=unigram --num_threads=1 --minloglevel=2 >/dev/null 2>&1")
                            .c_str()),
            0);
  RunResult tok =
      trainer.run({"tokenize", "--tokenizer", dir / "spm.model", dir / "text.txt", dir / "text.tokens"}, {}, 30);
  ASSERT_EQ(tok.exit_code, 0) << describe(tok);
  EXPECT_TRUE(contains(tok, "SentencePiece model " + dir / "spm.model" + " (vocabulary 40)")) << describe(tok);
  std::ifstream f(dir / "text.tokens", std::ios::binary);
  char header[32];
  ASSERT_TRUE(f.read(header, 32));
  EXPECT_EQ(static_cast<unsigned char>(header[16]), 40) << "the header records the tokenizer's vocabulary";

  const auto args = with(base_args(dir.path(), 10),
                         {"--model.vocab_size=40", "--data.source=tokens", "--data.path=" + dir / "text.tokens",
                          "--data.tokenizer=" + dir / "spm.model", "--sample.length=12", "--sample.prompt=the quick"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // The sample is text that starts with its prompt, decoded by the tokenizer, not token ids.
  EXPECT_TRUE(
      std::regex_search(r.out, std::regex("sample \\(12 tokens, temperature [0-9.]+\\):\n(\\[rank0\\]:)?the quick")))
      << describe(r);

  // Not a SentencePiece model: tokenize and data.tokenizer stop naming the file.
  RunResult bad =
      trainer.run({"tokenize", "--tokenizer", dir / "text.txt", dir / "text.txt", dir / "x.tokens"}, {}, 30);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(contains(bad, dir / "text.txt (--tokenizer): not a SentencePiece model")) << describe(bad);
  RunResult bad_key = trainer.run(with(args, {"--data.tokenizer=" + dir / "text.txt"}), {}, 60);
  EXPECT_NE(bad_key.exit_code, 0);
  EXPECT_TRUE(contains(bad_key, dir / "text.txt (data.tokenizer): not a SentencePiece model")) << describe(bad_key);
}

// tools/pretokenize.py: a byte-level BPE tokenizer.json (trained here with the tokenizers
// package, as Llama 3's and Qwen's are) into the same token files.
TEST(TrainerEval, PretokenizeScriptWritesTokenFilesTheTrainerReads) {
  FSDP_SKIP_WITHOUT_PYTHON();
  const Program python(FSDP_TEST_PYTHON);
  if (python.run({"-c", "import tokenizers"}, {}, 60).exit_code != 0)
    GTEST_SKIP() << "the tokenizers package is not in the project's venv (scripts/install-deps.sh installs it)";
  TempDir dir;
  std::ofstream(dir / "text.txt") << text_of(20000);
  std::ofstream(dir / "make_bpe.py")
      << "import sys\n"
         "from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers\n"
         "tok = Tokenizer(models.BPE())\n"
         "tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)\n"
         "tok.decoder = decoders.ByteLevel()\n"
         "trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())\n"
         "tok.train([sys.argv[1]], trainer)\n"
         "tok.save(sys.argv[2])\n";
  ASSERT_EQ(python.run({dir / "make_bpe.py", dir / "text.txt", dir / "tokenizer.json"}, {}, 120).exit_code, 0);
  RunResult pre = python.run(
      {FSDP_PRETOKENIZE_PY, "--tokenizer", dir / "tokenizer.json", dir / "text.txt", dir / "text.tokens"}, {}, 120);
  ASSERT_EQ(pre.exit_code, 0) << describe(pre);
  EXPECT_TRUE(contains(pre, "(vocabulary 280)")) << describe(pre);
  const auto args =
      with(base_args(dir.path(), 3), {"--model.vocab_size=280", "--data.source=tokens",
                                      "--data.path=" + dir / "text.tokens", "--eval.path=" + dir / "text.tokens"});
  RunResult r = fsdprun.run(under_fsdprun(2, args), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r, "vocab 280")) << describe(r);
}

}  // namespace
