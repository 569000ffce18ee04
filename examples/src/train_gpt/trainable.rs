//! What `train_gpt` needs of a model beyond `LanguageModel`: its Hugging Face form.

use std::path::Path;

use burn_tp::comm::ProcessGroup;
use burn_tp::gemma::{Gemma, GemmaConfig};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::hf::HfConfig;
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::model::LanguageModel;

/// What `train_gpt` needs of a model beyond [`LanguageModel`]: its Hugging Face form, where it
/// has one (`--init-from`, `--export-hf`; the arguments refuse them for the GPT first).
pub trait Trainable: LanguageModel {
    /// The Hugging Face configuration of a model built here from `config`.
    ///
    /// # Errors
    /// A model with no Hugging Face form.
    fn hf_config(config: &Self::Config) -> burn_tp::Result<HfConfig>;

    /// This model with the weights of the Hugging Face model in `dir`.
    ///
    /// # Errors
    /// The import's errors.
    fn load_hf(self, dir: &Path, group: &ProcessGroup) -> burn_tp::Result<Self> {
        burn_tp::hf::load(self, dir, group)
    }

    /// The model `config` describes with its experts split over `ep`, its weights those of the
    /// Hugging Face model in `dir`: this rank reads only its experts (never the whole model).
    /// Collective over `group` (tp).
    ///
    /// # Errors
    /// A model without experts; the import's errors.
    fn import_expert_parallel(
        config: &Self::Config,
        dir: &Path,
        (group, ep): (&ProcessGroup, &ProcessGroup),
        device: &burn::tensor::Device,
    ) -> burn_tp::Result<Self> {
        let _ = (config, dir, group, device);
        Err(burn_tp::TpError::Config(format!(
            "--ep {}: this model has no mixture-of-experts layers",
            ep.world_size()
        )))
    }

    /// The model with its experts split over `ep` (a model without experts at ep 1: itself).
    ///
    /// # Errors
    /// A model without experts at ep > 1; experts ep does not divide.
    fn expert_parallel(self, ep: &ProcessGroup) -> burn_tp::Result<Self> {
        match ep.world_size() {
            1 => Ok(self),
            n => Err(burn_tp::TpError::Config(format!(
                "--ep {n}: this model has no mixture-of-experts layers"
            ))),
        }
    }

    /// The model with every expert on every ep rank again (to save or export it). Collective
    /// over ep.
    ///
    /// # Errors
    /// A communication error.
    fn gather_experts(self) -> burn_tp::Result<Self> {
        Ok(self)
    }

    /// With LoRA: adapters on (`config`), or a PEFT adapter's (`peft`: its folder and the
    /// base's Hugging Face config), the rest frozen. Collective over tp.
    ///
    /// # Errors
    /// A model family without LoRA; LoRA's and the PEFT reader's errors.
    fn with_lora(
        self,
        config: Option<&burn_tp::lora::LoraConfig>,
        peft: Option<(&Path, &HfConfig)>,
    ) -> burn_tp::Result<Self> {
        let _ = (config, peft);
        Err(burn_tp::TpError::Config(
            "LoRA: the Llama family's models only".into(),
        ))
    }

    /// The model with its adapters merged into its weights (for a Hugging Face export).
    fn merge_lora(self) -> Self {
        self
    }

    /// QLoRA: the adapted linears' frozen base held in 8 bits (each rank its shard).
    ///
    /// # Errors
    /// A model family without LoRA.
    fn quantize_lora_base(self) -> burn_tp::Result<Self> {
        Err(burn_tp::TpError::Config(
            "QLoRA: the Llama family's models only".into(),
        ))
    }

    /// Writes the adapters of this whole (tp 1) model as a PEFT folder into `dir`.
    ///
    /// # Errors
    /// A model family without LoRA; the writer's errors.
    fn save_peft(&self, hf: &HfConfig, dir: &Path, base: Option<&str>) -> burn_tp::Result<()> {
        let _ = (hf, dir, base);
        Err(burn_tp::TpError::Config(
            "LoRA: the Llama family's models only".into(),
        ))
    }

    /// Writes the model in Hugging Face's format into `dir`, as the architecture of the model
    /// in `from` (the folder it was imported from: a fine-tuned Phi-3 is written back as a Phi-3,
    /// its fused tensors) if any, else the one `config` implies. Collective.
    ///
    /// # Errors
    /// The export's errors.
    fn save_hf(
        &self,
        config: &Self::Config,
        from: Option<&Path>,
        dir: &Path,
        group: &ProcessGroup,
    ) -> burn_tp::Result<()> {
        let hf = match from {
            Some(from) => HfConfig::from_dir(from)?,
            None => Self::hf_config(config)?,
        };
        burn_tp::hf::save(self, &hf, dir, group)
    }
}

impl Trainable for Gpt {
    fn hf_config(_: &GptConfig) -> burn_tp::Result<HfConfig> {
        Err(no_hf_form())
    }

    fn load_hf(self, _: &Path, _: &ProcessGroup) -> burn_tp::Result<Self> {
        Err(no_hf_form())
    }
}

fn no_hf_form() -> burn_tp::TpError {
    burn_tp::TpError::Config("the GPT has no Hugging Face form (the Llama has)".into())
}

impl Trainable for Llama {
    fn hf_config(config: &LlamaConfig) -> burn_tp::Result<HfConfig> {
        Ok(HfConfig::from_llama(config))
    }

    fn expert_parallel(self, ep: &ProcessGroup) -> burn_tp::Result<Self> {
        match self.expert_params().is_empty() && ep.world_size() > 1 {
            true => Err(burn_tp::TpError::Config(format!(
                "--ep {}: this model has no mixture-of-experts layers",
                ep.world_size()
            ))),
            false => Llama::expert_parallel(self, ep),
        }
    }

    fn gather_experts(self) -> burn_tp::Result<Self> {
        Llama::gather_experts(self)
    }

    fn import_expert_parallel(
        config: &LlamaConfig,
        dir: &Path,
        (group, ep): (&ProcessGroup, &ProcessGroup),
        device: &burn::tensor::Device,
    ) -> burn_tp::Result<Self> {
        let layers: Vec<usize> = (0..config.n_layers).collect();
        let model = config.init_expert_parallel(group, ep, device, &layers)?;
        burn_tp::hf::load_expert_parallel(model, dir, group, ep)
    }

    fn with_lora(
        self,
        config: Option<&burn_tp::lora::LoraConfig>,
        peft: Option<(&Path, &HfConfig)>,
    ) -> burn_tp::Result<Self> {
        match (config, peft) {
            (_, Some((dir, hf))) => burn_tp::hf::load_peft(self, dir, hf),
            (Some(config), None) => burn_tp::lora::apply_lora(self, config),
            (None, None) => Ok(self),
        }
    }

    fn merge_lora(self) -> Self {
        burn_tp::lora::merge_lora(self)
    }

    fn quantize_lora_base(self) -> burn_tp::Result<Self> {
        use burn::tensor::quantization::QuantValue;
        burn_tp::lora::quantize_base(self, QuantValue::Q8S)
    }

    fn save_peft(&self, hf: &HfConfig, dir: &Path, base: Option<&str>) -> burn_tp::Result<()> {
        burn_tp::hf::save_peft(self, dir, hf, base)
    }
}

impl Trainable for Gemma {
    fn hf_config(config: &GemmaConfig) -> burn_tp::Result<HfConfig> {
        HfConfig::from_gemma(config)
    }
}

/// `model` with `args`' LoRA adapters (`--lora-rank`, or `--peft-from`'s over `--init-from`'s
/// model), the rest frozen; itself without them.
///
/// # Errors
/// LoRA's and the PEFT reader's errors.
pub(super) fn lora_from_args<M: Trainable>(model: M, args: &super::Args) -> burn_tp::Result<M> {
    if !args.is_lora() {
        return Ok(model);
    }
    let hf = args
        .init_from
        .as_deref()
        .map(HfConfig::from_dir)
        .transpose()?;
    let peft = args.peft_from.as_deref().zip(hf.as_ref());
    model.with_lora(args.lora().as_ref(), peft)
}
