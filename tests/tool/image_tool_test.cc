// End-to-end tests of the gpulazy-image binary (synth -> info -> convert -> verify -> corrupt ->
// verify; profile; bad usage), plus unit tests of the access-order parser it uses.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lazy-server/image/lazy_image.h"
#include "lazy-server/tool/commands.h"
#include "proto/file_header.h"
#include "tests/support/files.h"
#include "tests/support/temp_dir.h"

namespace gpulazy::tool {
namespace {

using ::gpulazy::testing::TempDir;

std::string ReadFile(const std::filesystem::path& path) {
  return ::gpulazy::testing::ReadWholeFile(path);
}

void WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string Quote(const std::string& arg) {
  std::string quoted = "'";
  for (char c : arg)
    quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

struct ToolRun {
  int exit_code = -1;
  std::string out, err;
};

// Runs build/bin/gpulazy-image with `args`, capturing stdout and stderr through files.
class ToolTest : public ::testing::Test {
 protected:
  ToolRun Tool(const std::vector<std::string>& args) {
    std::string command = Quote(std::string(GPULAZY_BIN_DIR) + "/gpulazy-image");
    for (const auto& arg : args) {
      command += ' ';  // appended apart: GCC 12 at -O3 misreads " " + string&& (-Wrestrict)
      command += Quote(arg);
    }
    const auto out = scratch_.path() / "stdout", err = scratch_.path() / "stderr";
    command += " >" + Quote(out.string()) + " 2>" + Quote(err.string());
    int status = std::system(command.c_str());
    ToolRun run;
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.out = ReadFile(out);
    run.err = ReadFile(err);
    return run;
  }

  std::string Ckpt() const { return (work_.path() / "ckpt").string(); }

  // synth (2 processes, 2 GPUs, 32 MiB) + convert.
  void MakeLazyImage() {
    ToolRun synth = Tool({"synth", "--out", Ckpt(), "--gpus", "2", "--bos", "12", "--size", "32M",
                          "--seed", "9", "--processes", "2"});
    ASSERT_EQ(synth.exit_code, 0) << synth.err;
    ToolRun convert = Tool({"convert", Ckpt()});
    ASSERT_EQ(convert.exit_code, 0) << convert.err;
  }

  TempDir scratch_;  // captured output
  TempDir work_;     // images
};

bool MentionsNumber(const std::string& text, const std::string& word, uint64_t number) {
  const std::string needle = fmt::format("{} {}", word, number);
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    size_t end = at + needle.size();
    if (end == text.size() || !std::isdigit(static_cast<unsigned char>(text[end]))) return true;
  }
  return false;
}

TEST_F(ToolTest, SynthInfoConvertVerifyThenCorruptionIsNamed) {
  ToolRun synth = Tool({"synth", "--out", Ckpt(), "--gpus", "2", "--bos", "12", "--size", "32M",
                        "--seed", "9", "--processes", "2"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  EXPECT_NE(synth.out.find("32.0 MiB"), std::string::npos) << synth.out;

  ToolRun info = Tool({"info", Ckpt(), "--json"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  nlohmann::json j = nlohmann::json::parse(info.out);
  EXPECT_EQ(j["content_bytes"].get<uint64_t>(), 32u << 20);
  EXPECT_EQ(j["bo_count"].get<uint32_t>(), 24u);
  ASSERT_EQ(j["processes"].size(), 2u);
  for (const auto& p : j["processes"]) {
    EXPECT_EQ(p["bo_count"].get<uint32_t>(), 12u);
    EXPECT_EQ(p["content_bytes"].get<uint64_t>(), 16u << 20);
    ASSERT_EQ(p["devices"].size(), 2u);
    for (const auto& d : p["devices"]) {
      EXPECT_GT(d["vram_bytes"].get<uint64_t>(), 0u);
      EXPECT_GT(d["device_id"].get<uint32_t>(), 0u);
    }
  }
  for (const char* kind : {"vram", "gtt", "userptr", "doorbell"})
    EXPECT_GT(j["bos_by_kind"].value(kind, 0u), 0u) << kind;
  uint64_t per_gpu = 0;
  for (const auto& [gpu, bytes] : j["bytes_per_gpu"].items())
    per_gpu += bytes.get<uint64_t>();
  EXPECT_EQ(per_gpu, 32u << 20);
  EXPECT_TRUE(j["lazy"].is_null());

  ToolRun text = Tool({"info", Ckpt()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("lazy image: none"), std::string::npos) << text.out;

  ToolRun convert = Tool({"convert", Ckpt()});
  ASSERT_EQ(convert.exit_code, 0) << convert.err;
  EXPECT_NE(convert.out.find("chunks"), std::string::npos) << convert.out;

  info = Tool({"info", Ckpt(), "--json"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  j = nlohmann::json::parse(info.out);
  ASSERT_TRUE(j["lazy"].is_object()) << info.out;
  const auto& lazy = j["lazy"];
  EXPECT_EQ(lazy["chunk_size"].get<uint32_t>(), 2u << 20);
  uint64_t by_codec = 0;
  for (const auto& [codec, count] : lazy["chunks_by_codec"].items())
    by_codec += count.get<uint64_t>();
  EXPECT_EQ(by_codec, lazy["chunks"].get<uint64_t>());
  EXPECT_GT(lazy["chunks_by_codec"]["zero"].get<uint64_t>(), 0u);
  EXPECT_GT(lazy["chunks_by_codec"]["lz4"].get<uint64_t>(), 0u);
  EXPECT_GT(lazy["zero_ratio"].get<double>(), 0.0);
  EXPECT_GT(lazy["compression_ratio"].get<double>(), 0.0);
  EXPECT_LT(lazy["compression_ratio"].get<double>(), 1.0);
  EXPECT_GT(lazy["dedup_chunks"].get<uint64_t>(), 0u);  // process 2 replicates weights
  EXPECT_FALSE(lazy["profile"]["present"].get<bool>());

  ToolRun verify = Tool({"verify", Ckpt()});
  ASSERT_EQ(verify.exit_code, 0) << verify.err;
  EXPECT_NE(verify.out.find("ok"), std::string::npos) << verify.out;

  // Flip one byte in the middle of a stored chunk that no other chunk shares.
  auto image = image::LazyImage::Open(Ckpt());
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  std::map<uint64_t, int> users;
  for (const auto& bo : image->manifest().bos())
    for (const auto& chunk : bo.chunks())
      if (chunk.codec() != manifest::CODEC_ZERO) ++users[chunk.stored_offset()];
  int bad_bo = -1, bad_chunk = -1;
  uint64_t flip_at = 0;
  for (int b = 0; b < image->manifest().bos_size() && bad_bo < 0; ++b) {
    const auto& bo = image->manifest().bos(b);
    for (int c = 0; c < bo.chunks_size(); ++c) {
      const auto& chunk = bo.chunks(c);
      if (chunk.codec() == manifest::CODEC_ZERO || users[chunk.stored_offset()] != 1) continue;
      bad_bo = b;
      bad_chunk = c;
      flip_at = kFileHeaderSize + chunk.stored_offset() + chunk.stored_length() / 2;
      break;
    }
  }
  ASSERT_GE(bad_bo, 0) << "no stored chunk to corrupt";
  {
    std::fstream chunks(std::filesystem::path(Ckpt()) / image::kChunkFileName,
                        std::ios::in | std::ios::out | std::ios::binary);
    chunks.seekg(static_cast<std::streamoff>(flip_at));
    char byte = 0;
    chunks.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x5a);
    chunks.seekp(static_cast<std::streamoff>(flip_at));
    chunks.write(&byte, 1);
  }
  verify = Tool({"verify", Ckpt()});
  EXPECT_EQ(verify.exit_code, 1) << verify.out << verify.err;
  bool named = false;
  std::istringstream lines(verify.err);
  for (std::string line; std::getline(lines, line);)
    named |= MentionsNumber(line, "BO", static_cast<uint64_t>(bad_bo)) &&
             MentionsNumber(line, "chunk", static_cast<uint64_t>(bad_chunk));
  EXPECT_TRUE(named) << "BO " << bad_bo << " chunk " << bad_chunk << " not named in:\n"
                     << verify.err;
}

TEST_F(ToolTest, ConvertOptionsShowInInfo) {
  ToolRun synth = Tool({"synth", "--out", Ckpt(), "--size", "8M", "--bos", "8"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  ToolRun convert = Tool({"convert", Ckpt(), "--chunk-size", "64K", "--no-compress", "--no-dedup"});
  ASSERT_EQ(convert.exit_code, 0) << convert.err;
  ToolRun info = Tool({"info", Ckpt(), "--json"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  auto lazy = nlohmann::json::parse(info.out)["lazy"];
  EXPECT_EQ(lazy["chunk_size"].get<uint32_t>(), 64u << 10);
  EXPECT_EQ(lazy["chunks_by_codec"]["lz4"].get<uint64_t>(), 0u);
  EXPECT_EQ(lazy["dedup_chunks"].get<uint64_t>(), 0u);
  EXPECT_EQ(Tool({"verify", Ckpt()}).exit_code, 0);
}

TEST_F(ToolTest, BadUsageFailsWithAClearMessage) {
  ToolRun missing = Tool({"info", (work_.path() / "no-such-dir").string()});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("no-such-dir"), std::string::npos) << missing.err;

  ToolRun bad_size = Tool({"synth", "--out", Ckpt(), "--size", "12X"});
  EXPECT_EQ(bad_size.exit_code, 2);
  EXPECT_NE(bad_size.err.find("12X"), std::string::npos) << bad_size.err;
  EXPECT_FALSE(std::filesystem::exists(Ckpt()));

  ToolRun bad_gpus = Tool({"synth", "--out", Ckpt(), "--size", "8M", "--gpus", "0"});
  EXPECT_EQ(bad_gpus.exit_code, 2);
  EXPECT_NE(bad_gpus.err.find("--gpus"), std::string::npos) << bad_gpus.err;

  ToolRun no_command = Tool({});
  EXPECT_EQ(no_command.exit_code, 2);
  EXPECT_FALSE(no_command.err.empty());

  ToolRun unknown_option = Tool({"info", Ckpt(), "--frobnicate"});
  EXPECT_EQ(unknown_option.exit_code, 2);

  ASSERT_EQ(Tool({"synth", "--out", Ckpt(), "--size", "4M", "--bos", "4"}).exit_code, 0);
  ToolRun bad_chunk = Tool({"convert", Ckpt(), "--chunk-size", "3M"});
  EXPECT_EQ(bad_chunk.exit_code, 2);
  EXPECT_NE(bad_chunk.err.find("--chunk-size"), std::string::npos) << bad_chunk.err;

  ToolRun not_converted = Tool({"verify", Ckpt()});
  EXPECT_EQ(not_converted.exit_code, 1);
  EXPECT_NE(not_converted.err.find("convert"), std::string::npos) << not_converted.err;

  ToolRun again = Tool({"synth", "--out", Ckpt(), "--size", "4M"});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("already holds a checkpoint"), std::string::npos) << again.err;
}

TEST_F(ToolTest, ProfileRoundTrip) {
  MakeLazyImage();
  // An order over BOs 0 and 1 and a BO with at least two chunks.
  auto image = image::LazyImage::Open(Ckpt());
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  int big = -1;
  for (int b = 0; b < image->manifest().bos_size() && big < 0; ++b)
    if (b > 1 && image->manifest().bos(b).chunks_size() >= 2) big = b;
  ASSERT_GE(big, 0);
  const auto order = work_.path() / "order.txt";
  WriteFile(order, fmt::format("# hot first\n{} 1\n0 0   # embedding\n\n1 0\n{} 0\n", big, big));
  ToolRun set = Tool({"profile", Ckpt(), "--order", order.string(), "--hot", "2"});
  ASSERT_EQ(set.exit_code, 0) << set.err;
  EXPECT_NE(set.out.find("hot set 2"), std::string::npos) << set.out;

  ToolRun show = Tool({"profile", Ckpt(), "--show"});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find(fmt::format("{} 1\n0 0\n", big)), std::string::npos) << show.out;
  EXPECT_NE(show.out.find(fmt::format("1 0\n{} 0\n", big)), std::string::npos) << show.out;

  // What --show prints reads back as an order file and gives the same profile.
  const auto shown = work_.path() / "shown.txt";
  WriteFile(shown, show.out);
  ASSERT_EQ(Tool({"profile", Ckpt(), "--order", shown.string(), "--hot", "2"}).exit_code, 0);
  ToolRun show_again = Tool({"profile", Ckpt(), "--show"});
  ASSERT_EQ(show_again.exit_code, 0);
  auto body = [](const std::string& text) { return text.substr(text.find('\n')); };
  EXPECT_EQ(body(show_again.out), body(show.out));

  ToolRun info = Tool({"info", Ckpt(), "--json"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  auto profile = nlohmann::json::parse(info.out)["lazy"]["profile"];
  EXPECT_TRUE(profile["present"].get<bool>());
  EXPECT_EQ(profile["entries"].get<uint64_t>(), 4u);
  EXPECT_EQ(profile["hot_count"].get<uint32_t>(), 2u);
  EXPECT_EQ(Tool({"verify", Ckpt()}).exit_code, 0);

  // Invalid orders are refused, naming the file and line, and leave the profile alone.
  const auto bad = work_.path() / "bad.txt";
  WriteFile(bad, "0 0\n0 0\n");
  ToolRun duplicate = Tool({"profile", Ckpt(), "--order", bad.string()});
  EXPECT_EQ(duplicate.exit_code, 1);
  EXPECT_NE(duplicate.err.find("bad.txt:2"), std::string::npos) << duplicate.err;
  WriteFile(bad, "0 0\n100000 0\n");
  ToolRun out_of_range = Tool({"profile", Ckpt(), "--order", bad.string()});
  EXPECT_EQ(out_of_range.exit_code, 1);
  EXPECT_NE(out_of_range.err.find("bad.txt:2"), std::string::npos) << out_of_range.err;
  ToolRun too_hot = Tool({"profile", Ckpt(), "--order", order.string(), "--hot", "5"});
  EXPECT_EQ(too_hot.exit_code, 1);
  EXPECT_NE(too_hot.err.find("--hot"), std::string::npos) << too_hot.err;
  EXPECT_EQ(Tool({"profile", Ckpt(), "--show"}).out, show_again.out);
  EXPECT_EQ(Tool({"profile", Ckpt()}).exit_code, 2);
}

// ParseAccessOrder against a small hand-made manifest: BO 0 has 3 chunks, BO 1 has 1.
manifest::Manifest SmallManifest() {
  manifest::Manifest m;
  m.set_chunk_size(4096);
  for (int chunks : {3, 1}) {
    auto* bo = m.add_bos();
    for (int c = 0; c < chunks; ++c)
      bo->add_chunks()->set_raw_length(4096);
  }
  return m;
}

TEST(ParseAccessOrderTest, AcceptsCommentsBlankLinesAndDefaultsHotToAll) {
  auto profile = ParseAccessOrder("# x\n\n 0 2 \n1 0# tail\n\t0 0\r\n", SmallManifest(),
                                  std::nullopt, "o.txt");
  ASSERT_TRUE(profile.ok()) << profile.status().ToString();
  ASSERT_EQ(profile->order_size(), 3);
  EXPECT_EQ(profile->order(0).bo(), 0u);
  EXPECT_EQ(profile->order(0).chunk(), 2u);
  EXPECT_EQ(profile->order(1).bo(), 1u);
  EXPECT_EQ(profile->order(2).chunk(), 0u);
  EXPECT_EQ(profile->hot_count(), 3u);
}

TEST(ParseAccessOrderTest, RejectsWhatDoesNotFitTheImage) {
  const manifest::Manifest m = SmallManifest();
  struct Case {
    const char* text;
    std::optional<uint32_t> hot;
    const char* needle;
  };
  for (const Case& c :
       {Case{"0 3\n", std::nullopt, "o.txt:1: chunk 3 of BO 0"},
        Case{"2 0\n", std::nullopt, "o.txt:1: BO 2"},
        Case{"0 0\n1 0\n0 0\n", std::nullopt, "o.txt:3"}, Case{"0 x\n", std::nullopt, "o.txt:1"},
        Case{"0 0 0\n", std::nullopt, "o.txt:1"}, Case{"-1 0\n", std::nullopt, "o.txt:1"},
        Case{"# nothing\n", std::nullopt, "no 'bo chunk'"}, Case{"0 0\n", 2u, "--hot 2"}}) {
    auto profile = ParseAccessOrder(c.text, m, c.hot, "o.txt");
    ASSERT_FALSE(profile.ok()) << c.text;
    EXPECT_NE(profile.status().message().find(c.needle), std::string::npos)
        << profile.status().message();
  }
}

TEST(ParseChunkSizeTest, AcceptsPowersOfTwoInRange) {
  EXPECT_EQ(ParseChunkSize("2M").value(), 2u << 20);
  EXPECT_EQ(ParseChunkSize("4096").value(), 4096u);
  EXPECT_FALSE(ParseChunkSize("3M").ok());
  EXPECT_FALSE(ParseChunkSize("2K").ok());
  EXPECT_FALSE(ParseChunkSize("8M").ok());
  EXPECT_FALSE(ParseChunkSize("abc").ok());
}

}  // namespace
}  // namespace gpulazy::tool
