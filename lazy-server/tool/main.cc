// gpulazy-image: makes, inspects, converts and verifies checkpoint images. The commands live in
// commands.cc; this file parses the command line and turns a Status into an exit code:
// 0 success, 1 the operation failed, 2 bad usage.
#include <CLI/CLI.hpp>
#include <iostream>
#include <optional>
#include <string>

#include "lazy-server/tool/commands.h"
#include "proto/size.h"

namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

int Report(const char* command, const gpulazy::Status& status, int code) {
  if (status.ok()) return 0;
  std::cerr << "gpulazy-image " << command << ": " << status.message() << '\n';
  return code;
}

}  // namespace

static int Run(int argc, char** argv) {
  using namespace gpulazy;
  CLI::App app{"gpulazy-image: make, inspect, convert and verify gpulazy checkpoint images"};
  app.require_subcommand(1);

  image::SynthOptions synth;
  std::string synth_out, synth_size;
  CLI::App* synth_cmd = app.add_subcommand("synth", "write a synthetic CRIU amdgpu checkpoint");
  synth_cmd->add_option("--out", synth_out, "directory to write (created; must not hold images)")
      ->required();
  synth_cmd->add_option("--gpus", synth.gpus, "GPUs of the node, 1..64")->capture_default_str();
  synth_cmd->add_option("--bos", synth.bos, "BOs per process")->capture_default_str();
  synth_cmd->add_option("--size", synth_size, "content bytes over all processes (4K, 512M, 8G)")
      ->required();
  synth_cmd->add_option("--seed", synth.seed, "seed; equal seeds give equal files")
      ->capture_default_str();
  synth_cmd->add_option("--processes", synth.processes, "processes (amdgpu-kfd images)")
      ->capture_default_str();

  std::string dir;
  bool info_json = false;
  CLI::App* info_cmd = app.add_subcommand("info", "describe a checkpoint and its lazy image");
  info_cmd->add_option("DIR", dir, "checkpoint directory")->required();
  info_cmd->add_flag("--json", info_json, "print one JSON object");

  std::string chunk_size_text;
  bool no_compress = false, no_dedup = false;
  CLI::App* convert_cmd = app.add_subcommand("convert", "convert a checkpoint to a lazy image");
  convert_cmd->add_option("DIR", dir, "checkpoint directory")->required();
  convert_cmd->add_option("--chunk-size", chunk_size_text, "chunk size, a power of two (2M)");
  convert_cmd->add_flag("--no-compress", no_compress, "store every chunk raw");
  convert_cmd->add_flag("--no-dedup", no_dedup, "store equal chunks once each");

  CLI::App* verify_cmd =
      app.add_subcommand("verify", "check every lazy-image chunk against the CRIU checkpoint");
  verify_cmd->add_option("DIR", dir, "checkpoint directory")->required();

  std::string order_file;
  std::optional<uint32_t> hot;
  bool show = false;
  CLI::App* profile_cmd =
      app.add_subcommand("profile", "set or show the lazy image's access profile");
  profile_cmd->add_option("DIR", dir, "checkpoint directory")->required();
  auto* order_opt = profile_cmd->add_option(
      "--order", order_file, "text file of 'bo chunk' lines in streaming order ('#' comments)");
  auto* hot_opt = profile_cmd->add_option(
      "--hot", hot, "the first N entries form the hot set (default: all of them)");
  auto* show_opt = profile_cmd->add_flag("--show", show, "print the profile");
  show_opt->excludes(order_opt);
  hot_opt->needs(order_opt);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  if (synth_cmd->parsed()) {
    auto size = ParseSize(synth_size);
    if (!size.ok()) return Report("synth", size.status().Context("--size"), kExitUsage);
    synth.out = synth_out;
    synth.total_bytes = *size;
    if (Status valid = image::ValidateSynthOptions(synth); !valid.ok())
      return Report("synth", valid, kExitUsage);
    return Report("synth", tool::RunSynth(synth, std::cout), kExitFailed);
  }
  if (info_cmd->parsed())
    return Report("info", tool::RunInfo(dir, info_json, std::cout), kExitFailed);
  if (convert_cmd->parsed()) {
    image::ConvertOptions options;
    if (!chunk_size_text.empty()) {
      auto chunk_size = tool::ParseChunkSize(chunk_size_text);
      if (!chunk_size.ok()) return Report("convert", chunk_size.status(), kExitUsage);
      options.chunk_size = *chunk_size;
    }
    options.compress = !no_compress;
    options.deduplicate = !no_dedup;
    return Report("convert", tool::RunConvert(dir, options, std::cout), kExitFailed);
  }
  if (verify_cmd->parsed())
    return Report("verify", tool::RunVerify(dir, std::cout, std::cerr), kExitFailed);
  if (profile_cmd->parsed()) {
    if (show) return Report("profile", tool::RunProfileShow(dir, std::cout), kExitFailed);
    if (order_file.empty()) {
      std::cerr << "gpulazy-image profile: give --order FILE to set the profile or --show to "
                   "print it\n";
      return kExitUsage;
    }
    return Report("profile", tool::RunProfileSet(dir, order_file, hot, std::cout), kExitFailed);
  }
  return kExitUsage;
}

int main(int argc, char** argv) {
  // Nothing may escape main: a bad_alloc or a filesystem_error becomes a message and exit 1.
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpulazy-image: " << e.what() << '\n';
    return kExitFailed;
  }
}
