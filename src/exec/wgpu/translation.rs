//! Every variant of the gather shader through naga into every backend's language: SPIR-V
//! (Vulkan), MSL (Metal), HLSL (DX12) and GLSL ES 3.10 (GL), so that a shader change that could
//! not run on a backend fails here, on any machine. SPIR-V and GLSL are also checked by the
//! platform's validators where installed (`spirv-val` from SPIRV-Tools, `glslangValidator`);
//! `HICACHE_REQUIRE_SHADER_TOOLS=1` (CI) makes a missing one a failure.

use super::gather::shader_source;
use naga::back::{glsl, hlsl, msl, spv};
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// `(name, WGSL, 64-bit integers)` of every pipeline the executor can build.
fn variants() -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    for word in ["u32", "vec4<u32>"] {
        for (sum, int64) in [(false, false), (true, false), (true, true)] {
            out.push((format!("gather<{word}> sum={sum} int64={int64}"), shader_source(word, sum, int64), int64));
        }
    }
    out
}

/// Runs `tool args… file` on `text` written to a temporary file; `None` when the tool is absent.
fn validate_with(tool: &str, args: &[&str], ext: &str, bytes: &[u8]) -> Option<Result<(), String>> {
    let dir = std::env::temp_dir().join(format!("hicache-io-shaders-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let file = dir.join(format!("shader.{ext}"));
    std::fs::write(&file, bytes).ok()?;
    let out = match std::process::Command::new(tool).args(args).arg(&file).output() {
        Ok(o) => o,
        Err(_) if std::env::var("HICACHE_REQUIRE_SHADER_TOOLS").as_deref() == Ok("1") => {
            return Some(Err(format!("{tool} is not installed (HICACHE_REQUIRE_SHADER_TOOLS=1)")))
        }
        Err(_) => return None,
    };
    let _ = std::fs::remove_dir_all(&dir);
    Some(if out.status.success() {
        Ok(())
    } else {
        Err(format!("{tool}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    })
}

#[test]
fn every_gather_variant_translates_for_every_backend() {
    let mut checked = Vec::new();
    for (name, src, int64) in variants() {
        let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
        let caps = if int64 { Capabilities::SHADER_INT64 } else { Capabilities::empty() };
        let info = Validator::new(ValidationFlags::all(), caps).validate(&module).unwrap_or_else(|e| panic!("{name}: {e:?}"));

        let words = spv::write_vec(&module, &info, &spv::Options::default(), None).unwrap_or_else(|e| panic!("{name} to SPIR-V: {e}"));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        if let Some(r) = validate_with("spirv-val", &["--target-env", "vulkan1.1"], "spv", &bytes) {
            r.unwrap_or_else(|e| panic!("{name}: {e}"));
            checked.push("spirv-val");
        }

        // Metal: 64-bit integers need MSL 2.3.
        let msl_opts = msl::Options { lang_version: if int64 { (2, 3) } else { (2, 0) }, ..Default::default() };
        msl::write_string(&module, &info, &msl_opts, &msl::PipelineOptions::default()).unwrap_or_else(|e| panic!("{name} to MSL: {e}"));

        // DX12: 64-bit integers need shader model 6.0 (DXC).
        let hlsl_opts =
            hlsl::Options { shader_model: if int64 { hlsl::ShaderModel::V6_0 } else { hlsl::ShaderModel::V5_1 }, ..Default::default() };
        let mut hlsl_out = String::new();
        hlsl::Writer::new(&mut hlsl_out, &hlsl_opts, &hlsl::PipelineOptions::default())
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{name} to HLSL: {e}"));

        // GL (ES 3.10 compute) has no 64-bit integers: the executor never builds that variant there.
        if !int64 {
            let mut bindings = glsl::BindingMap::default();
            for (_, var) in module.global_variables.iter() {
                if let Some(b) = &var.binding {
                    bindings.insert(*b, b.binding as u8);
                }
            }
            let opts = glsl::Options { binding_map: bindings, ..Default::default() };
            let pipeline = glsl::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: "main".into(), multiview: None };
            let mut glsl_out = String::new();
            glsl::Writer::new(&mut glsl_out, &module, &info, &opts, &pipeline, naga::proc::BoundsCheckPolicies::default())
                .and_then(|mut w| w.write())
                .unwrap_or_else(|e| panic!("{name} to GLSL ES: {e}"));
            if let Some(r) = validate_with("glslangValidator", &["-S", "comp"], "comp", glsl_out.as_bytes()) {
                r.unwrap_or_else(|e| panic!("{name}: {e}\n{glsl_out}"));
                checked.push("glslangValidator");
            }
        }
    }
    eprintln!("shader variants translated to SPIR-V, MSL, HLSL and GLSL ES; validated by {:?}", {
        checked.sort();
        checked.dedup();
        checked
    });
}
