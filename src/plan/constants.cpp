// constants.cpp — the machine's measured rates (fsdp/plan.h): configs/plan_constants.json, built
// into the library by CMake (plan_constants_json.h), or any such file parsed at run time.
#include <fsdp/plan.h>

#include "plan_constants_json.h"

#include <nlohmann/json.hpp>

#include <stdexcept>

namespace fsdp {
namespace plan {

Constants constants_from_json(const std::string& json_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("fsdp::plan: the constants are not valid JSON: ") + e.what());
  }
  auto number_in = [](const nlohmann::json& o, const std::string& key) {
    if (!o.contains(key) || !o[key].is_number())
      throw std::invalid_argument("fsdp::plan: the constants have no number '" + key +
                                  "'; regenerate them with bench/plan_constants.py");
    return o[key].get<double>();
  };
  auto number = [&](const char* key) { return number_in(j, key); };
  auto rates = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_object())
      throw std::invalid_argument(std::string("fsdp::plan: the constants have no object '") + key +
                                  "'; regenerate them with bench/plan_constants.py");
    const nlohmann::json& o = j[key];
    ComputeRates r;
    const std::string in = std::string(key) + ".";
    r.matmul_flops_fp32 = number_in(o, "matmul_flops_fp32");
    r.matmul_flops_bf16 = number_in(o, "matmul_flops_bf16");
    r.elementwise_bytes_per_s_fp32 = number_in(o, "elementwise_bytes_per_s_fp32");
    r.elementwise_bytes_per_s_bf16 = number_in(o, "elementwise_bytes_per_s_bf16");
    if (r.matmul_flops_fp32 <= 0 || r.matmul_flops_bf16 <= 0 || r.elementwise_bytes_per_s_fp32 <= 0 ||
        r.elementwise_bytes_per_s_bf16 <= 0)
      throw std::invalid_argument("fsdp::plan: the constants' " + in + "* rates must be positive");
    return r;
  };
  Constants c;
  c.cpu_cores = static_cast<int>(number("cpu_cores"));
  c.one_thread = rates("one_thread");
  c.single_rank = rates("single_rank");
  c.memory_bytes_per_s = number("memory_bytes_per_s");
  c.collective_bytes_per_s = number("collective_bytes_per_s");
  c.collective_latency_s = number("collective_latency_s");
  c.collective_latency_s_oversubscribed = number("collective_latency_s_oversubscribed");
  c.mpi_collective_bytes_per_s = number("mpi_collective_bytes_per_s");
  c.mpi_collective_latency_s = number("mpi_collective_latency_s");
  c.mpi_collective_latency_s_oversubscribed = number("mpi_collective_latency_s_oversubscribed");
  c.stage_overhead_s = number("stage_overhead_s");
  c.bf16_stage_overhead_s = number("bf16_stage_overhead_s");
  c.checkpointed_stage_overhead_s = number("checkpointed_stage_overhead_s");
  c.runtime_rss_bytes = number("runtime_rss_bytes");
  c.rss_per_tensor_byte = number("rss_per_tensor_byte");
  if (c.memory_bytes_per_s <= 0 || c.collective_bytes_per_s <= 0 || c.mpi_collective_bytes_per_s <= 0 ||
      c.cpu_cores < 1)
    throw std::invalid_argument("fsdp::plan: the constants' bandwidths and cpu_cores must be positive");
  c.source = j.value("source", std::string());
  return c;
}

Constants measured_constants() {
  static const Constants built_in = constants_from_json(kPlanConstantsJson);
  return built_in;
}

}  // namespace plan
}  // namespace fsdp
