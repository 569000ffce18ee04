//! `#[derive(Reshard)]` and `#[derive(Twin)]` (below) for burn-tp.
//!
//! `#[derive(Reshard)]`: `burn_tp::reshard::Reshard` for a struct of one's own whose fields
//! move between tensor-parallel sizes on their own (burn-tp's parallel layers, `Vec`s and
//! `Option`s of them, bare replicated `Param`s, other derived modules).
//!
//! Field attributes:
//! - `#[reshard(group)]`: the struct's own `ProcessGroup`; a group of one in the full module,
//!   the target group in a shard, and the rank its layout is read at.
//! - `#[reshard(keep)]`, or `#[module(skip)]`: a run-time setting, cloned as it is.
//!
//! ```ignore
//! #[derive(Module, Debug, Reshard)]
//! struct Block {
//!     attn: ParallelAttention,
//!     mlp: ParallelMlp,
//!     #[module(skip)]
//!     mode: TpMode,
//! }
//! ```

use proc_macro::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Fields, parse_macro_input};

/// Derives `burn_tp::reshard::Reshard` field by field (see the crate's docs).
#[proc_macro_derive(Reshard, attributes(reshard))]
pub fn derive_reshard(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(|e| e.to_compile_error())
        .into()
}

enum Role {
    Moves,
    Group,
    Keep,
}

fn role(field: &syn::Field) -> syn::Result<Role> {
    let mut role = Role::Moves;
    for attr in &field.attrs {
        if attr.path().is_ident("reshard") {
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("group") {
                    role = Role::Group;
                    Ok(())
                } else if meta.path.is_ident("keep") {
                    role = Role::Keep;
                    Ok(())
                } else {
                    Err(meta.error("expected `#[reshard(group)]` or `#[reshard(keep)]`"))
                }
            })?;
        } else if attr.path().is_ident("module") && matches!(role, Role::Moves) {
            // `#[module(skip)]`: not a module, so a setting to copy.
            let mut skip = false;
            attr.parse_nested_meta(|meta| {
                skip |= meta.path.is_ident("skip");
                Ok(())
            })?;
            if skip {
                role = Role::Keep;
            }
        }
    }
    Ok(role)
}

/// The struct's named fields, or an error naming the derive.
fn named_fields<'a>(input: &'a DeriveInput, derive: &str) -> syn::Result<&'a syn::FieldsNamed> {
    if let Data::Struct(data) = &input.data
        && let Fields::Named(fields) = &data.fields
    {
        return Ok(fields);
    }
    Err(syn::Error::new_spanned(
        &input.ident,
        format!("#[derive({derive})] takes a struct with named fields"),
    ))
}

fn expand(input: &DeriveInput) -> syn::Result<proc_macro2::TokenStream> {
    let name = &input.ident;
    let fields = named_fields(input, "Reshard")?;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut full = Vec::new();
    let mut sharded = Vec::new();
    let mut layout = Vec::new();
    let mut group = None;
    for field in &fields.named {
        let f = field.ident.as_ref().expect("named field");
        match role(field)? {
            Role::Moves => {
                full.push(quote! { #f: ::burn_tp::reshard::Reshard::to_full_module(&self.#f)? });
                sharded.push(
                    quote! { #f: ::burn_tp::reshard::Reshard::shard_module(&full.#f, group)? },
                );
                layout.push(
                    quote! { out.extend(::burn_tp::reshard::Reshard::layout(&self.#f, rank)); },
                );
            }
            Role::Group => {
                if group.is_some() {
                    return Err(syn::Error::new_spanned(
                        f,
                        "#[derive(Reshard)]: one `#[reshard(group)]` field at most",
                    ));
                }
                group = Some(f.clone());
                full.push(quote! { #f: ::burn_tp::reshard::solo() });
                sharded.push(quote! { #f: group.clone() });
            }
            Role::Keep => {
                full.push(quote! { #f: ::core::clone::Clone::clone(&self.#f) });
                sharded.push(quote! { #f: ::core::clone::Clone::clone(&full.#f) });
            }
        }
    }
    let rank = match &group {
        Some(g) => quote! { let rank = self.#g.rank(); },
        None => quote! {},
    };
    Ok(quote! {
        impl #impl_generics ::burn_tp::reshard::Reshard for #name #ty_generics #where_clause {
            fn to_full_module(&self) -> ::burn_tp::Result<Self> {
                Ok(::burn_tp::reshard::keep_frozen(self, Self { #(#full,)* }))
            }
            fn shard_module(
                full: &Self,
                group: &::burn_tp::comm::ProcessGroup,
            ) -> ::burn_tp::Result<Self> {
                Ok(::burn_tp::reshard::keep_frozen(full, Self { #(#sharded,)* }))
            }
            #[allow(unused_variables, unused_mut)]
            fn layout(&self, rank: usize) -> ::std::vec::Vec<::burn_tp::reshard::ParamLayout> {
                #rank
                let mut out = ::std::vec::Vec::new();
                #(#layout)*
                out
            }
        }
    })
}

/// Derives `burn_tp::reshard::Twin<F>` field by field, `F` named by the struct's `#[twin(F)]`:
/// every module field from / to `F`'s field of the same name; the `#[reshard(group)]` field is
/// the context's group; a setting field (`#[module(skip)]` or `#[reshard(keep)]`) says where its
/// value comes from: `#[twin(mode)]` (the context's `TpMode`), `#[twin(settings)]` (its
/// `TpSettings`) or `#[twin(default)]`.
///
/// ```ignore
/// #[derive(Module, Debug, Reshard, Twin)]
/// #[twin(PlainMlp)]
/// struct MyMlp {
///     fc1: ColumnParallelLinear,
///     fc2: RowParallelLinear,
///     #[module(skip)]
///     #[twin(mode)]
///     mode: TpMode,
/// }
/// ```
#[proc_macro_derive(Twin, attributes(twin))]
pub fn derive_twin(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand_twin(&input)
        .unwrap_or_else(|e| e.to_compile_error())
        .into()
}

fn twin_of(input: &DeriveInput) -> syn::Result<syn::Type> {
    for attr in &input.attrs {
        if attr.path().is_ident("twin") {
            return attr.parse_args::<syn::Type>();
        }
    }
    Err(syn::Error::new_spanned(
        &input.ident,
        "#[derive(Twin)] needs the plain twin's type: #[twin(PlainModule)]",
    ))
}

/// A setting field's source: `mode`, `settings` or `default`.
fn setting_source(field: &syn::Field) -> syn::Result<Option<proc_macro2::TokenStream>> {
    let mut source = None;
    for attr in &field.attrs {
        if attr.path().is_ident("twin") {
            attr.parse_nested_meta(|meta| {
                source = Some(if meta.path.is_ident("mode") {
                    quote! { ctx.settings.mode }
                } else if meta.path.is_ident("settings") {
                    quote! { ctx.settings }
                } else if meta.path.is_ident("default") {
                    quote! { ::core::default::Default::default() }
                } else {
                    return Err(
                        meta.error("expected #[twin(mode)], #[twin(settings)] or #[twin(default)]")
                    );
                });
                Ok(())
            })?;
        }
    }
    Ok(source)
}

fn expand_twin(input: &DeriveInput) -> syn::Result<proc_macro2::TokenStream> {
    let name = &input.ident;
    let twin = twin_of(input)?;
    let fields = named_fields(input, "Twin")?;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let (mut from, mut to) = (Vec::new(), Vec::new());
    for field in &fields.named {
        let f = field.ident.as_ref().expect("named field");
        match role(field)? {
            Role::Moves => {
                from.push(quote! { #f: ::burn_tp::reshard::Twin::from_twin(&full.#f, ctx)? });
                to.push(quote! { #f: ::burn_tp::reshard::Twin::to_twin(&self.#f)? });
            }
            Role::Group => from.push(quote! { #f: ctx.group.clone() }),
            Role::Keep => match setting_source(field)? {
                Some(source) => from.push(quote! { #f: #source }),
                None => {
                    return Err(syn::Error::new_spanned(
                        f,
                        "#[derive(Twin)]: say where this setting comes from: #[twin(mode)], \
                         #[twin(settings)] or #[twin(default)]",
                    ));
                }
            },
        }
    }
    Ok(quote! {
        impl #impl_generics ::burn_tp::reshard::Twin<#twin> for #name #ty_generics #where_clause {
            fn from_twin(
                full: &#twin,
                ctx: &::burn_tp::reshard::TwinContext,
            ) -> ::burn_tp::Result<Self> {
                Ok(Self { #(#from,)* })
            }
            fn to_twin(&self) -> ::burn_tp::Result<#twin> {
                Ok(#twin { #(#to,)* })
            }
        }
    })
}
